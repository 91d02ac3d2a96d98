"""SplitQuant's offline planner (`morphling plan`): per-layer bits, layer-to-device placement and micro-batch
sizes for a heterogeneous cluster, from a memory model, a phase-aware latency model and the variance
indicator, solved as an ILP (docs/splitquant.md)."""
