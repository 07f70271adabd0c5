"""edgefcl: online federated continual learning on edge devices."""

__version__ = "0.1.0"
