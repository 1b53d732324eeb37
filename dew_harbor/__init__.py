"""Harbor plug-ins dew ships for machines without a container engine; imported by Harbor's Python, never by dew.

``dew_harbor.bubblewrap:BubblewrapEnvironment`` is a Harbor environment (``harbor trials start
--env dew_harbor.bubblewrap:BubblewrapEnvironment`` with this checkout on ``PYTHONPATH``).
"""
