"""The controller: runs pure policies on the cluster state and sends their commands (DESIGN.md, "The controller's ladder")."""
