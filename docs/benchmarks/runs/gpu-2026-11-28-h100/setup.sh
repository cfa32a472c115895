#!/bin/bash
# Installs what Meridian needs beside the device image's python3 (torch is the image's). Idempotent on a warm machine.
set -u
[ -f /tmp/meridian-setup.done ] && { echo "setup: already done"; exit 0; }
t0=$(date +%s)
PY=$(command -v python3)
BIN=$(dirname "$PY")
SITE=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
echo "python $PY site $SITE nproc $(nproc) kernel $(uname -r)"
nvidia-smi -L || true
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
command -v ip tc || { echo "no iproute2: using the carried one"; }
ls -la /dev/net/tun || true
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .devrun/whl/*.whl 2>&1 | tail -5
tar -xJf .devrun/ray-slim.tar.xz -C "$SITE"
cat > "$BIN/ray" <<EOF
#!$PY
import sys
from ray.scripts.scripts import main
sys.exit(main())
EOF
chmod +x "$BIN/ray"
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  mkdir -p /opt/iproute && cp .devrun/iproute/* /opt/iproute/
  for b in ip tc; do printf '#!/bin/sh\nLD_LIBRARY_PATH=/opt/iproute exec /opt/iproute/%s "$@"\n' $b > /usr/local/bin/$b; chmod +x /usr/local/bin/$b; done
fi
(cd /tmp && "$PY" -c 'import ray, fastapi, meridian.cli.main; print("ray", ray.__version__)') || exit 1
command -v meridian ray
# Can this kernel host the lab? (namespaces, veth, tun, tbf)
ip netns add mtest && ip link add mt0 type veth peer name mt1 && ip tuntap add dev mtun mode tun \
  && tc qdisc add dev mt0 root tbf rate 1gbit burst 256kb latency 50ms && echo "lab primitives: ok"
ip link del mt0 2>/dev/null; ip tuntap del dev mtun mode tun 2>/dev/null; ip netns del mtest 2>/dev/null
tc qdisc add dev lo root netem delay 1ms 2>/dev/null && { echo "netem: present"; tc qdisc del dev lo root; } || echo "netem: absent"
touch /tmp/meridian-setup.done
echo "setup took $(( $(date +%s) - t0 )) s"
