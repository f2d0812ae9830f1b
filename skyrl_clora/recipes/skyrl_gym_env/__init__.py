"""Any env registered with skyrl-gym, on SkyRL-format parquet files (``data.train_data`` / ``data.val_data``)."""
