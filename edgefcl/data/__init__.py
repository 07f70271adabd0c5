"""Data: dataset loaders, class-incremental task splits, one-pass streams."""
