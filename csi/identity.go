package csi

import (
	"context"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// GetPluginInfo returns the driver's name and version.
func (d *Driver) GetPluginInfo(context.Context, *csipb.GetPluginInfoRequest) (*csipb.GetPluginInfoResponse, error) {
	return &csipb.GetPluginInfoResponse{Name: d.cfg.DriverName, VendorVersion: d.cfg.Version}, nil
}

// GetPluginCapabilities: the controller service (in controller and all
// modes), topology, online expansion.
func (d *Driver) GetPluginCapabilities(context.Context, *csipb.GetPluginCapabilitiesRequest) (*csipb.GetPluginCapabilitiesResponse, error) {
	svc := func(t csipb.PluginCapability_Service_Type) *csipb.PluginCapability {
		return &csipb.PluginCapability{Type: &csipb.PluginCapability_Service_{Service: &csipb.PluginCapability_Service{Type: t}}}
	}
	caps := []*csipb.PluginCapability{
		svc(csipb.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS),
		{Type: &csipb.PluginCapability_VolumeExpansion_{VolumeExpansion: &csipb.PluginCapability_VolumeExpansion{
			Type: csipb.PluginCapability_VolumeExpansion_ONLINE}}},
	}
	if d.cfg.Mode.controller() {
		caps = append([]*csipb.PluginCapability{svc(csipb.PluginCapability_Service_CONTROLLER_SERVICE)}, caps...)
	}
	return &csipb.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
}

// Probe is cheap and local: it answers ready whenever the process serves
// CSI, without a cluster round trip and without waiting for the node's
// recovery. The livenessprobe sidecar calls it with a one-second timeout
// and restarts the container on an error *and* on ready=false, so a Probe
// that consulted the cluster would restart the controller whenever the
// stor cluster has no leader, and one that waited for recovery would kill
// the node plugin mid-recovery. Whether the driver is ready for work (the
// cluster reachable with a leader; staged volumes recovered) is Ready,
// served over HTTP as /readyz (see Health).
func (d *Driver) Probe(context.Context, *csipb.ProbeRequest) (*csipb.ProbeResponse, error) {
	return &csipb.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}
