"""A pod rehearsal: the `train` workflow's tasks each in their own "pod", as a cluster runs them.

Every task runs in a fresh OS process with its own network namespace (an address on a private
bridge), mount, PID and UTS namespaces, an empty tmpfs disk, and the repo as an overlayfs image;
the pods share nothing but a SeaweedFS S3 endpoint and an `mlflow server` on a "storage" host.
Only what a task returns reaches the next one, so a task that hands on a local path fails here
as it would on Kubernetes.

netns.py builds the network (or says it cannot and falls back to loopback), pods.py starts one
pod, servers.py the storage host's servers, cluster.py puts the three together, graph.py walks
the workflow's compiled graph, driver.py runs it pod by pod with fault injection and Flyte's
deadlines, registration.py serializes the workflows as `pyflyte package` does, flyte_rules.py
holds the rules flyteadmin and propeller apply (registration, clamping, deadlines), outputs.py
checks what tasks return, and pod_main.py is what runs inside a pod (probes.py, probe_tasks.py
and checks.py are what the tests run there). Only root on Linux gets real isolation; elsewhere
the rehearsal says so and runs plain processes.
"""
