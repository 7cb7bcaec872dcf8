"""``python -m taken_port ARGV`` is ``python -m hpctrain ARGV`` in which torch elastic's pick of a
free port returns ``$HPCTRAIN_TEST_TAKEN_PORT``, a port the test holds.

torch elastic picks a port for rank 0's store by binding port 0 and closing the socket, and rank
0 binds it again once it has imported (seconds): anyone may take the port meanwhile, another
user's launch on the login node or a job beside ours. This makes that collision certain instead
of rare.
"""

from __future__ import annotations

import os
import runpy

from torch.distributed.elastic.rendezvous import api

TAKEN_PORT_ENV = "HPCTRAIN_TEST_TAKEN_PORT"

if __name__ == "__main__":
    api.get_free_port = lambda: int(os.environ[TAKEN_PORT_ENV])
    runpy.run_module("hpctrain", run_name="__main__", alter_sys=True)
