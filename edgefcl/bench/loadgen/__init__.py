"""Load generation for `edgefcl bench fleet`: lightweight devices that publish pre-made valid
updates (no training), many per process with one MQTT connection each, and a plain subscriber
that only counts what the broker delivers."""
