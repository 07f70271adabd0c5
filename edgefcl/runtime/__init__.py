"""Networked runtime: the aggregator daemon, the device client and the stream replayer, driving
the transport-free learning cores over MQTT."""
