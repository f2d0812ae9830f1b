"""What runs inside SkyRL's Ray workers (policy workers over the embedded trainer, their tenant stores and patches,
Megatron checkpoints and seeding); the driver side of ``backend=skyrl`` is ``skyrl_clora.backends.skyrl.backend``.

Ray actors import SkyRL's registries (``ppo_utils``) through these modules, and plain ``pickle`` fails on them while
``ppo_utils`` imports: the ``cloudpickle`` they need is given to SkyRL before any of them imports."""

from skyrl_clora.placement.ray_session import give_skyrl_cloudpickle

give_skyrl_cloudpickle()
