"""Transport: topics, wire codec (msgpack), MQTT client wrapper, embedded broker."""
