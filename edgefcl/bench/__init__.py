"""`edgefcl bench`: benchmarks and studies that print numbers and write JSON, apart from the
library they measure (nothing in the library imports them). One module per benchmark: client,
transport, fleet (with its load generator, `loadgen/`), backpressure, shard, crash, fuzz, flood,
async_study, memory."""
