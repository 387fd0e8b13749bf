"""Ray placement of a training run (`trueflow train --ray`, docs/scaling.md): trainer ranks and rollout engines as
Ray actors in one placement group. `launch.run_ray` is the driver; `actors` holds the trainer ranks; their engine and
reward actors are placements (`trueflow.placement.ray`)."""


class RayRunError(RuntimeError):
    """A Ray run stopped on something other than bad input: an actor died, or a rank failed. The message is one
    line naming the actor."""
