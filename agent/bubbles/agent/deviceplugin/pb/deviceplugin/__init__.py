"""The kubelet's device plugin API (proto/deviceplugin/): the stubs here are made by tools/gen-proto.sh; do not edit."""
