"""What is measured and against what: timers, the device, CPU threads, the copy floors, the metrics catalogue."""
