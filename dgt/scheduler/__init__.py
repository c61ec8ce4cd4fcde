"""Send order, lane priorities, per-round deadlines and loss accounting between rounds."""
