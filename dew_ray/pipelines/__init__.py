"""Driver programs: ``python -m dew_ray.pipelines.rlvr`` (asynchronous RLVR on Ray) and ``.chain`` (stage chains)."""
