"""The monitor: turns executor telemetry into the smoothed cluster state (DESIGN.md, "Processes")."""
