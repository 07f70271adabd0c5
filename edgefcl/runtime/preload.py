"""Imported once by the fleet launcher's forkserver (see launcher.py): everything a role needs
before it can start work."""

import torch  # noqa: F401

import edgefcl.build  # noqa: F401
import edgefcl.data.workload  # noqa: F401
import edgefcl.learn.export  # noqa: F401
import edgefcl.runtime.aggregator_daemon  # noqa: F401
import edgefcl.runtime.device_runner  # noqa: F401
import edgefcl.runtime.replayer  # noqa: F401
import edgefcl.runtime.roles  # noqa: F401
