"""When a system is back at rest between two windows: the bench's rule, read from GET /v1/cluster's body, which
`morphling bench` polls (suite.settle) and `morphling simulate` builds from its monitor's state."""


def shape(cluster: dict) -> dict:
    """Everything the controller can have moved, from GET /v1/cluster: layer bits and batch caps per executor,
    the instances' members, placements and bits."""
    return {"executors": sorted((e["id"], tuple(e["layers"]), e["max_num_seqs"]) for e in cluster["executors"]
                                if e["alive"]),
            "instances": sorted((i["id"], tuple(i["members"]), i["tp"], tuple(map(str, i["layers"])))
                                for i in cluster["instances"])}


def at_rest(cluster: dict) -> dict:
    """What a cluster at rest has back as it started: every pressure action undone (no layer below its starting
    bits, the batch caps, the members and TP degree) but not the placement, since CoCoServe's rest is replicas
    on idle capacity."""
    return {"executors": shape(cluster)["executors"],
            "instances": sorted((i["id"], tuple(i["members"]), i["tp"], tuple(layer["bits"] for layer in i["layers"]))
                                for i in cluster["instances"])}
