"""The kubelet's PodResources API (proto/podresources/): the stubs here are made by tools/gen-proto.sh; do not edit."""
