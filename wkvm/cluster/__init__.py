"""Several engine replicas behind one endpoint on Ray Serve (`wkvm serve --replicas N`)."""
