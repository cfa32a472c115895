"""``meridian bench lowcomm``'s sparse rows and ``--sweep``: which rows run, with which knobs, and the one table the
sweep writes. Without processes: the strategies and the table are pure functions of the arguments and rows."""

from __future__ import annotations

from meridian.bench.lowcomm import markdown_table, sparse_name, strategies, sweep_table
from meridian.cli.bench import build_parser


def _args(*argv: str):
    args = build_parser().parse_args(["lowcomm", "--overlap-steps", "3", *argv])
    return args


def test_default_rows_add_plain_and_streaming_sparse_beside_the_dense_ones():
    names = [s.name for s in strategies(_args())]
    assert names[0] == "har" and "diloco+int4/H32" in names and "torchft-streaming-diloco/H32" in names
    assert sparse_name("sparse-diloco+keep", 2, 0.02, 32) == "sparse-diloco+keep/2bit/d0.02/H32" in names
    assert "sparse-streaming-diloco+keep/2bit/d0.02/H32" in names
    o = next(s for s in strategies(_args()) if s.name == "sparse-streaming-diloco+keep/2bit/d0.02/H32").sync.outer
    assert (o.sparse_keep_unsent, o.outer_lr, o.outer_momentum, o.merge.value) == (True, 2.0, 0.0, "keep-progress")
    s = next(s for s in strategies(_args("--sparse-error-decay", "0.9", "--sparse-outer-lr", "1", "--sparse-unsent",
                                         "restart")) if s.name == "sparse-streaming-diloco/2bit/d0.02/H32")  # fmt: skip
    o = s.sync.outer
    assert (o.sparse_density, o.sparse_value_bits, o.sparse_block, o.sparse_error_decay) == (0.02, 2, 4096, 0.9)
    assert (o.outer_lr, o.outer_momentum, o.fragments, o.overlap_steps) == (1.0, 0.0, 4, 3)
    assert not o.sparse_keep_unsent
    assert s.sync.compression.value == "none"
    assert not any(n.startswith("sparse") for n in (s.name for s in strategies(_args("--sparse-density"))))


def test_final_average_adds_a_row_per_encoding_to_every_meridian_diloco_row():
    rows = {s.name: s for s in strategies(_args("--final-average", "off", "bf16"))}
    for name in ("diloco+int4/H32", "streaming-diloco+int8/H32", "sparse-streaming-diloco+keep/2bit/d0.02/H32"):
        assert rows[name].sync.outer.final_average.value == "off"
        assert rows[f"{name}/avg-bf16"].sync.outer.final_average.value == "bf16"
    assert not any(n.startswith("torchft") and "avg" in n for n in rows) and "har/avg-bf16" not in rows
    only = [s.name for s in strategies(_args("--final-average", "int8"))]
    assert "diloco+int4/H32/avg-int8" in only and "diloco+int4/H32" not in only


def test_the_sweep_runs_every_combination_of_h_density_and_bits_and_no_dense_meridian_rows():
    args = _args("--sweep", "--inner-steps", "16", "32", "--sparse-density", "0.01", "0.03", "--sparse-value-bits",
                 "2", "4")  # fmt: skip
    names = [s.name for s in strategies(args)]
    sparse = [n for n in names if n.startswith("sparse")]
    assert len(sparse) == 2 * 2 * 2 * 2  # plain and streaming × H × density × bits
    assert {sparse_name("sparse-streaming-diloco+keep", b, d, h) for b in (2, 4) for d in (0.01, 0.03)
            for h in (16, 32)} <= set(names)  # fmt: skip
    assert not any("+int" in n for n in names) and "har" in names
    assert {"torchft-diloco/H16", "torchft-streaming-diloco/H32"} <= set(names)


def test_the_sweep_table_has_every_sparse_row_and_torchfts_best_per_h():
    def row(engine, h=None, loss=1.0, **kw):
        return {"engine": engine, "inner_steps": h, "final_val_loss": loss, "bytes_reduction_vs_har": 1.0,
                "loss_gap_vs_har": 0.0, "compute_utilisation": 0.5, **kw}  # fmt: skip

    report = {
        "har": row("meridian"),
        "sparse-diloco/2bit/d0.02/H32": row("meridian", 32, 1.1, compression="sparse", sparse_density=0.02,
                                            sparse_value_bits=2),  # fmt: skip
        "torchft-diloco/H32": row("torchft", 32, 1.3),
        "torchft-streaming-diloco/H32": row("torchft", 32, 1.2),
    }
    table = sweep_table(report)
    assert [r["strategy"] for r in table] == ["har", "sparse-diloco/2bit/d0.02/H32",
                                              "torchft-streaming-diloco/H32 (torchft's best at H=32)"]  # fmt: skip
    md = markdown_table(table).splitlines()
    assert md[0].startswith("| strategy | inner_steps | sparse_density | sparse_value_bits |") and len(md) == 2 + 3
    assert "| sparse-diloco/2bit/d0.02/H32 | 32 | 0.02 | 2 |" in md[3]
