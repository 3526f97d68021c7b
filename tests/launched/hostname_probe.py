"""Launched under horovodrun by the tests, on a host whose name does not resolve.

Usage: python [-X dev] hostname_probe.py OUT_DIR
Goes through hvd_train's hostname preparation as a rank does (it may
re-execute this script under the loopback fix), then writes what the rank
and a child of it see to OUT_DIR/rank-N.json.
"""

import json
import os
import socket
import subprocess
import sys

from hvd_train.distributed import hostname

notice = hostname.prepare_rank(argv_given=False)
child = subprocess.run(
    [sys.executable, "-c", "import os, socket; print(socket.gethostname()); print(os.environ.get('LD_PRELOAD', ''))"],
    capture_output=True,
    text=True,
    check=True,
).stdout.splitlines()
seen = {
    "notice": notice,
    "gethostname": socket.gethostname(),
    "real_name": hostname.real_name(),
    "loopback_for": hostname.loopback_for(),
    "dev_mode": sys.flags.dev_mode,
    "prefix": sys.prefix,
    "env_flag": os.environ.get(hostname.SHIM_FLAG),
    "env_preload": os.environ.get("LD_PRELOAD", ""),
    "child_gethostname": child[0],
    "child_preload": child[1] if len(child) > 1 else "",
}
with open(os.path.join(sys.argv[1], f"rank-{os.environ.get('HOROVOD_RANK', '0')}.json"), "w") as f:
    json.dump(seen, f)
