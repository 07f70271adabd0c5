"""The deterministic asynchronous simulator: the async aggregator and devices in one process
on a virtual clock, with each device's timing drawn from a profile and the seed
(`profiles.py`), driven by a discrete-event queue (`clock.py`, `fleet.py`)."""
