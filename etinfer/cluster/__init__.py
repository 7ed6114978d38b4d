"""Scale-out on Ray Serve (``etinfer serve --replicas N``; needs ``pip install 'etinfer[ray]'``).

- ``launch``: the cluster, the deployments and their lifetime;
- ``ingress``: the OpenAI endpoint in front of the replicas;
- ``replica``: one engine as a Serve replica, answering as the single server does;
- ``router`` / ``routing_policy``: where a request will finish soonest (Serve's request-router
  extension point, and the policy itself, which needs no Ray);
- ``metrics``: every replica's metrics, and the router's, on one ``/metrics``.

Nothing here is imported without ``--replicas``.
"""
