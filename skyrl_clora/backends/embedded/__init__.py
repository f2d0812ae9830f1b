"""The embedded backend: the project's own sampler, trainer and sync on one shared base model (``services``), the
GPU memory plan they start from (``memory_plan``), the versioned in-place publication (``sync``) and the tenant
loop's backend over them with the run of a whole pool (``backend``)."""
