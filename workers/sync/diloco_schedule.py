"""When each part of the model crosses the WAN under (streaming) DiLoCo: a pure schedule, no torch.

Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512, §2) cuts the parameters into P fragments and
syncs fragment p after inner steps ``t`` with ``t ≡ offset_p (mod H)``, offsets spread evenly over the
cycle, so the WAN carries 1/P of the model every H/P steps instead of all of it every H steps. Plain DiLoCo
(arXiv:2311.08105) is P = 1, offset 0. A fragment's all-reduce is issued after inner step ``t`` and applied
``overlap_steps`` (tau) steps later, so it runs behind tau steps of compute.

Fragments are contiguous groups of whole parameters, balanced by element count in the engine's order. Every rank computes the same schedule
from the same numbers, which is what keeps their inter-DC collectives in the same order.

Warm-up: the first ``warmup_steps`` inner steps run the same schedule with a short cycle,
:func:`warmup_cycle` (the shortest the fragments and the overlap allow, and at least H / 4), while the
replicas drift apart fastest; then the cycle of H steps starts. ``warmup_steps`` is a whole number of short cycles, so every fragment has synced
when the long cycle begins.
"""

from __future__ import annotations

from dataclasses import dataclass


def split_fragments(numels: list[int], fragments: int, *, what: str = "parameters") -> tuple[tuple[int, ...], ...]:
    """Contiguous groups of indices of ``numels`` (the elements of each of the model's ``what``, in order), as even
    in elements as whole ones allow, none empty."""
    if fragments < 1:
        raise ValueError(f"fragments must be >= 1, got {fragments}")
    if fragments > len(numels):
        raise ValueError(
            f"{fragments} fragments need at least as many {what}, the model has {len(numels)}; "
            "lower sync.diloco.fragments"
        )
    total = sum(numels)
    out: list[tuple[int, ...]] = []
    current: list[int] = []
    done = 0
    for i, n in enumerate(numels):
        current.append(i)
        done += n
        left_items, left_frags = len(numels) - i - 1, fragments - len(out) - 1
        # close the fragment once it reached its share, or when every later one must start its own
        if left_frags and (done >= total * (len(out) + 1) / fragments or left_items == left_frags):
            out.append(tuple(current))
            current = []
    out.append(tuple(current))
    return tuple(out)


def warmup_cycle(inner_steps: int, fragments: int, overlap_steps: int) -> int:
    """Inner steps per cycle during the warm-up: ``max(fragments × (overlap_steps + 1), H // 4)``."""
    return max(fragments * (overlap_steps + 1), inner_steps // 4)


@dataclass(frozen=True)
class FragmentSchedule:
    """Which fragment's sync starts, and which lands, after each inner step."""

    inner_steps: int
    """H: each fragment is synced once every H inner steps."""
    fragments: int
    overlap_steps: int = 0
    warmup_steps: int = 0
    """Inner steps at the start with the short cycle :attr:`warmup_cycle` instead of H."""

    def __post_init__(self) -> None:
        if self.inner_steps < 1 or self.fragments < 1 or self.fragments > self.inner_steps:
            raise ValueError(
                f"need 1 <= fragments ({self.fragments}) <= inner_steps ({self.inner_steps})"
            )
        if not 0 <= self.overlap_steps < self.inner_steps:  # a fragment lands before its own next sync starts
            raise ValueError(f"overlap_steps ({self.overlap_steps}) must be in [0, inner_steps = {self.inner_steps})")
        if self.warmup_steps and self.warmup_cycle > self.inner_steps:
            raise ValueError(f"a warm-up cycle of {self.warmup_cycle} steps syncs less often than H = "
                             f"{self.inner_steps}: set warmup_steps to 0")
        if self.warmup_steps % self.warmup_cycle:
            raise ValueError(
                f"warmup_steps ({self.warmup_steps}) must be a multiple of the warm-up's cycle, "
                f"{self.warmup_cycle} steps"
            )

    @property
    def warmup_cycle(self) -> int:
        return warmup_cycle(self.inner_steps, self.fragments, self.overlap_steps)

    def _phase(self, done: int) -> tuple[int, int]:
        """``(steps into the phase, cycle length)`` after ``done`` inner steps."""
        if done <= self.warmup_steps:
            return done, self.warmup_cycle
        return done - self.warmup_steps, self.inner_steps

    def offset(self, fragment: int, cycle: int | None = None) -> int:
        """Inner steps into each cycle after which ``fragment``'s sync starts (the last ones sync at H)."""
        return (fragment + 1) * (cycle or self.inner_steps) // self.fragments

    def starting(self, done: int) -> list[int]:
        """Fragments whose all-reduce is issued once ``done`` inner steps are complete (``done`` >= 1)."""
        t, h = self._phase(done)
        return [p for p in range(self.fragments) if t >= 1 and t % h == self.offset(p, h) % h]

    def landing(self, done: int) -> list[int]:
        """Fragments whose all-reduce, issued ``overlap_steps`` steps earlier, is applied at ``done``."""
        return self.starting(done - self.overlap_steps) if done - self.overlap_steps >= 1 else []

    def cycle(self, start: int = 1) -> list[tuple[int, int]]:
        """``(inner step, fragment)`` of every sync started in the H steps from ``start`` (after the warm-up):
        each fragment once."""
        return [(t, p) for t in range(start, start + self.inner_steps) for p in self.starting(t)]
