"""firmware_sim: simulated edge devices running the real edgefcl client inside device-like
limits (memory, compute, radio link, flash, reboots), and a fleet launcher with fault
injection. Run `python -m firmware_sim --help` from the repository root."""
