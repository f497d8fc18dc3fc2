"""The agent's Kubernetes device plugin (issue 36, step 1): each GPU of the node as an extended resource of fill slots.

A fill Pod is to reach exactly the training's GPU(s) through something the kubelet applies (a CDI device, NVIDIA's
mounts or variable, set from the plugin's answer) instead of ``NVIDIA_VISIBLE_DEVICES`` in its own spec, which GPU
Operator with CDI, GKE and Bottlerocket do not honour. ``decide`` is the pure part (what to advertise, what to answer),
``guard`` the pure check of ``PreStartContainer`` (only the fill Pods assigned a GPU start on it), ``shell`` the gRPC
servers, the kubelet registration and the check's asking of the kubelet around them. Served behind ``bubbles agent
--cluster --device-plugin``; the operator's fill Pods do not request these resources yet.
"""
