"""What a run writes: the record writer, the one atomic JSON writer and the results directory."""
