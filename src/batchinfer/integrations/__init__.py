"""Running batchinfer on other systems: Ray Serve replicas and Ray Data jobs
(`pip install 'batchinfer[ray]'`)."""
