"""Federation: update encodings, aggregation strategies, round schedule, the Aggregator."""
