package csi

import (
	"context"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"

	storpb "github.com/stor-io/stor/api/proto"
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

// Probe is ready when the cluster answers (controller) and the node has
// registered itself and recovered its staged volumes (node). Not ready is reported as
// ready=false, not as an error, as the spec asks.
func (d *Driver) Probe(ctx context.Context, _ *csipb.ProbeRequest) (*csipb.ProbeResponse, error) {
	ready := true
	if d.cfg.Mode.controller() {
		cctx, cancel := d.call(ctx)
		st, err := d.cfg.Cluster.Cluster.Status(cctx, &storpb.StatusRequest{})
		cancel()
		switch {
		case err != nil:
			d.log.Warn("probe: the cluster does not answer", "err", err)
			ready = false
		case st.GetLeaderId() == "":
			d.log.Warn("probe: the cluster has no leader")
			ready = false
		}
	}
	if d.node != nil && (!d.node.registered.Load() || !d.node.recovered.Load()) {
		ready = false
	}
	return &csipb.ProbeResponse{Ready: wrapperspb.Bool(ready)}, nil
}
