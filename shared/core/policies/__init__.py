"""The controller's policies: pure functions of (cluster state, history, config) -> commands.

Each module is one rung of the ladder in DESIGN.md ("The controller's ladder"); they stay free of
the bus so that the simulator can run the very same code.
"""

from shared.core.policies.morph import MorphMemory, MorphSettings, make_policy, plan, settings_for_mode

__all__ = ["MorphMemory", "MorphSettings", "make_policy", "plan", "settings_for_mode"]
