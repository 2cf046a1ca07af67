package csi

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"time"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	storpb "github.com/stor-io/stor/api/proto"
)

// publish_context keys.
const (
	ctxNode     = "stor.io/node"
	ctxReadOnly = "stor.io/read-only"
)

type controllerServer struct {
	d *Driver
	csipb.UnimplementedControllerServer
}

var controllerCaps = []csipb.ControllerServiceCapability_RPC_Type{
	csipb.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME,
	csipb.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME,
	csipb.ControllerServiceCapability_RPC_LIST_VOLUMES,
	csipb.ControllerServiceCapability_RPC_GET_CAPACITY,
	csipb.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT,
	csipb.ControllerServiceCapability_RPC_LIST_SNAPSHOTS,
	csipb.ControllerServiceCapability_RPC_CLONE_VOLUME,
	csipb.ControllerServiceCapability_RPC_PUBLISH_READONLY,
	csipb.ControllerServiceCapability_RPC_EXPAND_VOLUME,
	csipb.ControllerServiceCapability_RPC_LIST_VOLUMES_PUBLISHED_NODES,
	csipb.ControllerServiceCapability_RPC_GET_VOLUME_HEALTH,
	csipb.ControllerServiceCapability_RPC_LIST_VOLUME_HEALTH,
	csipb.ControllerServiceCapability_RPC_GET_VOLUME,
	csipb.ControllerServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	csipb.ControllerServiceCapability_RPC_GET_SNAPSHOT,
}

func (c *controllerServer) ControllerGetCapabilities(context.Context, *csipb.ControllerGetCapabilitiesRequest) (*csipb.ControllerGetCapabilitiesResponse, error) {
	var out []*csipb.ControllerServiceCapability
	for _, t := range controllerCaps {
		out = append(out, &csipb.ControllerServiceCapability{Type: &csipb.ControllerServiceCapability_Rpc{
			Rpc: &csipb.ControllerServiceCapability_RPC{Type: t}}})
	}
	return &csipb.ControllerGetCapabilitiesResponse{Capabilities: out}, nil
}

func (c *controllerServer) getVolume(ctx context.Context, id string) (*storpb.Volume, error) {
	cctx, cancel := c.d.call(ctx)
	defer cancel()
	resp, err := c.d.cfg.Cluster.Volumes.GetVolume(cctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
	if err != nil {
		if clusterCode(err) == codes.NotFound {
			return nil, notFoundf("volume %q", id)
		}
		return nil, err
	}
	if resp.GetVolume().GetState() == storpb.VolumeState_VOLUME_STATE_DELETED {
		return nil, notFoundf("volume %q was deleted (the cluster keeps its data only for its snapshots)", id)
	}
	return resp.GetVolume(), nil
}

func (c *controllerServer) csiVolume(v *storpb.Volume) *csipb.Volume {
	out := &csipb.Volume{
		VolumeId: v.GetId(), CapacityBytes: int64(v.GetSizeBytes()),
		AccessibleTopology: c.d.accessibleTopology(v),
	}
	if fs := v.GetParameters()[ParamFSType]; fs != "" {
		out.VolumeContext = map[string]string{ParamFSType: fs}
	}
	switch s := v.GetContentSource().GetSource().(type) {
	case *storpb.ContentSource_SnapshotId:
		out.ContentSource = &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Snapshot{
			Snapshot: &csipb.VolumeContentSource_SnapshotSource{SnapshotId: s.SnapshotId}}}
	case *storpb.ContentSource_VolumeId:
		out.ContentSource = &csipb.VolumeContentSource{Type: &csipb.VolumeContentSource_Volume{
			Volume: &csipb.VolumeContentSource_VolumeSource{VolumeId: s.VolumeId}}}
	}
	return out
}

// CreateVolume creates (or returns, by name) a volume. The accessible
// topology it returns is the zones the requisite restricts its replicas
// to, or none; never a node (see accessibleTopology).
//
// A clone of a volume is filled from a snapshot the cluster takes of the
// source, which its engine cuts when it learns of it: the call returns
// once it is cut (cloneSourceCut), so that a write acknowledged after it
// returned is not in the clone. Its ends are CreateSnapshot's: a failed
// snapshot deletes the clone (INTERNAL); one not cut when the call's time
// is nearly up (a source attached to a dead node: nothing writes it) is
// answered with the clone.
func (c *controllerServer) CreateVolume(ctx context.Context, req *csipb.CreateVolumeRequest) (*csipb.CreateVolumeResponse, error) {
	if req.GetName() == "" {
		return nil, invalidf("CreateVolume: no name")
	}
	if err := checkCaps(req.GetVolumeCapabilities()); err != nil {
		return nil, err
	}
	params, err := parseParams(req.GetParameters())
	if err != nil {
		return nil, err
	}
	size, err := roundSize(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	requisite, preferred, err := c.d.placement(req.GetAccessibilityRequirements())
	if err != nil {
		return nil, err
	}
	unlock, err := c.d.locks.lock("name/" + req.GetName())
	if err != nil {
		return nil, err
	}
	defer unlock()

	creq := &storpb.CreateVolumeRequest{
		Name: req.GetName(), SizeBytes: size, ReplicaCount: params.replicas, Parameters: params.stored(),
	}
	if len(requisite)+len(preferred) > 0 {
		creq.Accessibility = &storpb.TopologyRequirement{Requisite: requisite, Preferred: preferred}
	}
	switch s := req.GetVolumeContentSource().GetType().(type) {
	case nil:
	case *csipb.VolumeContentSource_Snapshot:
		id := s.Snapshot.GetSnapshotId()
		cctx, cancel := c.d.call(ctx)
		snap, err := c.d.cfg.Cluster.Snapshots.GetSnapshot(cctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: id}})
		cancel()
		switch {
		case clusterCode(err) == codes.NotFound || id == "":
			return nil, notFoundf("source snapshot %q", id)
		case err != nil:
			return nil, err
		case snap.GetSnapshot().GetSizeBytes() > size:
			return nil, fmt.Errorf("%w: the source snapshot is %d bytes, more than the %d requested", ErrOutOfRange, snap.GetSnapshot().GetSizeBytes(), size)
		}
		creq.ContentSource = &storpb.ContentSource{Source: &storpb.ContentSource_SnapshotId{SnapshotId: id}}
	case *csipb.VolumeContentSource_Volume:
		id := s.Volume.GetVolumeId()
		src, err := c.getVolume(ctx, id)
		if err != nil {
			return nil, err
		}
		if src.GetSizeBytes() > size {
			return nil, fmt.Errorf("%w: the source volume is %d bytes, more than the %d requested", ErrOutOfRange, src.GetSizeBytes(), size)
		}
		creq.ContentSource = &storpb.ContentSource{Source: &storpb.ContentSource_VolumeId{VolumeId: id}}
	default:
		return nil, invalidf("unknown volume content source")
	}
	cctx, cancel := c.d.call(ctx)
	resp, err := c.d.cfg.Cluster.Volumes.CreateVolume(cctx, creq)
	cancel()
	if err != nil {
		return nil, err
	}
	if creq.GetContentSource().GetVolumeId() != "" && resp.GetVolume().GetCloneSnapshotId() != "" {
		if err := c.cloneSourceCut(ctx, resp.GetVolume()); err != nil {
			return nil, err
		}
	}
	return &csipb.CreateVolumeResponse{Volume: c.csiVolume(resp.GetVolume())}, nil
}

// DeleteVolume deletes a volume; an unknown one is success. A volume with
// snapshots is kept by the cluster for them, out of every user's view,
// until the last is deleted (snapshots outlive their volume, as
// Kubernetes assumes); for CSI it is deleted, and deleting it again is
// success too.
func (c *controllerServer) DeleteVolume(ctx context.Context, req *csipb.DeleteVolumeRequest) (*csipb.DeleteVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalidf("DeleteVolume: no volume id")
	}
	unlock, err := c.d.locks.lock("vol/" + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	cctx, cancel := c.d.call(ctx)
	defer cancel()
	_, err = c.d.cfg.Cluster.Volumes.DeleteVolume(cctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: id}})
	if clusterCode(err) == codes.NotFound {
		return &csipb.DeleteVolumeResponse{}, nil
	}
	if err != nil {
		return nil, err
	}
	return &csipb.DeleteVolumeResponse{}, nil
}

// knownNode reports whether a node id is a registered node (a node plugin
// registers itself at start) or a stor-server id (a server that attaches
// volumes as a client, without a node plugin), and the node's volume
// limit: the one its node plugin registered (its NodeGetInfo
// max_volumes_per_node), 0 for none (a stor-server id, a plugin that
// registered no limit).
func (c *controllerServer) knownNode(ctx context.Context, node string) (known bool, limit int64, err error) {
	cctx, cancel := c.d.call(ctx)
	defer cancel()
	n, err := c.d.cfg.Cluster.Cluster.GetNode(cctx, &storpb.GetNodeRequest{Id: node})
	switch {
	case err == nil:
		return true, n.GetNode().GetMaxVolumes(), nil
	case clusterCode(err) == codes.NotFound:
	case clusterCode(err) == codes.Unimplemented: // a cluster older than the node registry
	default:
		return false, 0, err
	}
	resp, err := c.d.cfg.Cluster.Cluster.ListServers(cctx, &storpb.ListServersRequest{})
	if err != nil {
		return false, 0, err
	}
	for _, s := range resp.GetServers() {
		if s.GetId() == node {
			return true, 0, nil
		}
	}
	return false, 0, nil
}

// ControllerPublishVolume attaches the volume to the node (a new epoch);
// see the package documentation for idempotency and fencing.
func (c *controllerServer) ControllerPublishVolume(ctx context.Context, req *csipb.ControllerPublishVolumeRequest) (*csipb.ControllerPublishVolumeResponse, error) {
	id, node := req.GetVolumeId(), req.GetNodeId()
	switch {
	case id == "":
		return nil, invalidf("ControllerPublishVolume: no volume id")
	case node == "":
		return nil, invalidf("ControllerPublishVolume: no node id")
	case req.GetVolumeCapability() == nil:
		return nil, invalidf("ControllerPublishVolume: no volume capability")
	}
	if err := checkCap(req.GetVolumeCapability()); err != nil {
		return nil, err
	}
	readOnly := req.GetReadonly() ||
		req.GetVolumeCapability().GetAccessMode().GetMode() == csipb.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY
	unlock, err := c.d.locks.lock("vol/" + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	v, err := c.getVolume(ctx, id)
	if err != nil {
		return nil, err
	}
	known, lim, err := c.knownNode(ctx, node)
	if err != nil {
		return nil, err
	} else if !known {
		return nil, notFoundf("node %q is neither a registered node nor a stor server", node)
	}
	mode := storpb.AccessMode_ACCESS_MODE_READ_WRITE
	if readOnly {
		mode = storpb.AccessMode_ACCESS_MODE_READ_ONLY
	}
	pubCtx := map[string]string{ctxNode: node, ctxReadOnly: strconv.FormatBool(readOnly)}
	if at := v.GetAttachment(); at != nil {
		switch {
		case at.GetNodeId() != node:
			return nil, preconditionf("volume %q is published to node %q; unpublish it there first", id, at.GetNodeId())
		case at.GetMode() != mode:
			return nil, fmt.Errorf("%w: volume %q is published to node %q with mode %v, not %v", ErrAlreadyExists, id, node, at.GetMode(), mode)
		}
		// Already published here: no new attach, no new epoch.
		return &csipb.ControllerPublishVolumeResponse{PublishContext: pubCtx}, nil
	}
	// The node's own limit, as its plugin registered it: the controller
	// has no say in how many nbd devices a node has. Counted and attached
	// under the node's lock too: two publishes of different volumes to a
	// node one short of its limit both counted room for themselves.
	if lim > 0 {
		unlockNode, err := c.d.locks.lock("node/" + node)
		if err != nil {
			return nil, err
		}
		defer unlockNode()
		vols, err := c.allVolumes(ctx)
		if err != nil {
			return nil, err
		}
		var n int64
		for _, v := range vols {
			if v.GetAttachment().GetNodeId() == node {
				n++
			}
		}
		if n >= lim {
			return nil, fmt.Errorf("%w: node %q has %d volumes published, the limit it registered", ErrTooMany, node, n)
		}
	}
	cctx, cancel := c.d.call(ctx)
	defer cancel()
	_, err = c.d.cfg.Cluster.Volumes.AttachVolume(cctx, &storpb.AttachVolumeRequest{
		Volume: &storpb.VolumeRef{Id: id}, NodeId: node, Mode: mode,
	})
	if err != nil {
		return nil, err
	}
	return &csipb.ControllerPublishVolumeResponse{PublishContext: pubCtx}, nil
}

// ControllerUnpublishVolume detaches the volume from the node; a volume
// that is unknown or not attached there is success.
func (c *controllerServer) ControllerUnpublishVolume(ctx context.Context, req *csipb.ControllerUnpublishVolumeRequest) (*csipb.ControllerUnpublishVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalidf("ControllerUnpublishVolume: no volume id")
	}
	unlock, err := c.d.locks.lock("vol/" + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	cctx, cancel := c.d.call(ctx)
	defer cancel()
	_, err = c.d.cfg.Cluster.Volumes.DetachVolume(cctx, &storpb.DetachVolumeRequest{
		Volume: &storpb.VolumeRef{Id: id}, NodeId: req.GetNodeId(),
	})
	if err != nil && clusterCode(err) != codes.NotFound {
		return nil, err
	}
	return &csipb.ControllerUnpublishVolumeResponse{}, nil
}

func (c *controllerServer) ValidateVolumeCapabilities(ctx context.Context, req *csipb.ValidateVolumeCapabilitiesRequest) (*csipb.ValidateVolumeCapabilitiesResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalidf("ValidateVolumeCapabilities: no volume id")
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, invalidf("ValidateVolumeCapabilities: no volume capabilities")
	}
	if _, err := c.getVolume(ctx, id); err != nil {
		return nil, err
	}
	if _, err := parseParams(req.GetParameters()); err != nil {
		return &csipb.ValidateVolumeCapabilitiesResponse{Message: err.Error()}, nil
	}
	if err := checkCaps(req.GetVolumeCapabilities()); err != nil {
		return &csipb.ValidateVolumeCapabilitiesResponse{Message: err.Error()}, nil
	}
	return &csipb.ValidateVolumeCapabilitiesResponse{Confirmed: &csipb.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext: req.GetVolumeContext(), VolumeCapabilities: req.GetVolumeCapabilities(), Parameters: req.GetParameters(),
	}}, nil
}

// allVolumes lists every volume, sorted by id.
func (c *controllerServer) allVolumes(ctx context.Context) ([]*storpb.Volume, error) {
	var out []*storpb.Volume
	token := ""
	for {
		cctx, cancel := c.d.call(ctx)
		resp, err := c.d.cfg.Cluster.Volumes.ListVolumes(cctx, &storpb.ListVolumesRequest{PageSize: 500, PageToken: token})
		cancel()
		if err != nil {
			return nil, err
		}
		out = append(out, resp.GetVolumes()...)
		if token = resp.GetNextPageToken(); token == "" {
			break
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].GetId() < out[j].GetId() })
	return out, nil
}

// allNodes lists every registered node, following the cluster's pages.
func (c *controllerServer) allNodes(ctx context.Context) ([]*storpb.Node, error) {
	var out []*storpb.Node
	token := ""
	for {
		resp, err := c.d.cfg.Cluster.Cluster.ListNodes(ctx, &storpb.ListNodesRequest{PageSize: 500, PageToken: token})
		if err != nil {
			return nil, err
		}
		out = append(out, resp.GetNodes()...)
		next := resp.GetNextPageToken()
		if next == "" {
			return out, nil
		}
		if next == token {
			return nil, fmt.Errorf("listing nodes: the cluster returned page token %q twice", next)
		}
		token = next
	}
}

// listVolumes reads one page of the cluster's volumes (deleted volumes
// left out), a listing's list.
func (c *controllerServer) listVolumes(ctx context.Context, token string, size uint32) ([]*storpb.Volume, string, error) {
	resp, err := c.d.cfg.Cluster.Volumes.ListVolumes(ctx, &storpb.ListVolumesRequest{PageSize: size, PageToken: token})
	return resp.GetVolumes(), resp.GetNextPageToken(), err
}

// ListVolumes lists volumes sorted by id, paged by max_entries and
// maxListBytes; each page reads the cluster's listing from where the
// previous one ended (listToken).
func (c *controllerServer) ListVolumes(ctx context.Context, req *csipb.ListVolumesRequest) (*csipb.ListVolumesResponse, error) {
	l := listing[*storpb.Volume, *csipb.ListVolumesResponse_Entry]{
		kind: listVolumes, list: c.listVolumes, id: (*storpb.Volume).GetId,
		entry: func(v *storpb.Volume) (*csipb.ListVolumesResponse_Entry, bool) {
			return &csipb.ListVolumesResponse_Entry{
				Volume: c.csiVolume(v),
				Status: &csipb.ListVolumesResponse_VolumeStatus{PublishedNodeIds: publishedNodes(v)},
			}, true
		},
	}
	entries, next, err := l.page(ctx, c, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	return &csipb.ListVolumesResponse{Entries: entries, NextToken: next}, nil
}

func publishedNodes(v *storpb.Volume) []string {
	if at := v.GetAttachment(); at != nil {
		return []string{at.GetNodeId()}
	}
	return nil
}

func (c *controllerServer) ControllerGetVolume(ctx context.Context, req *csipb.ControllerGetVolumeRequest) (*csipb.ControllerGetVolumeResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, invalidf("ControllerGetVolume: no volume id")
	}
	v, err := c.getVolume(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	return &csipb.ControllerGetVolumeResponse{
		Volume: c.csiVolume(v),
		Status: &csipb.ControllerGetVolumeResponse_VolumeStatus{PublishedNodeIds: publishedNodes(v)},
	}, nil
}

// ControllerGetVolumeHealth reports the replica set's health.
func (c *controllerServer) ControllerGetVolumeHealth(ctx context.Context, req *csipb.ControllerGetVolumeHealthRequest) (*csipb.ControllerGetVolumeHealthResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, invalidf("ControllerGetVolumeHealth: no volume id")
	}
	v, err := c.getVolume(ctx, req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	return &csipb.ControllerGetVolumeHealthResponse{VolumeHealth: health(v)}, nil
}

// ControllerListVolumeHealth lists the abnormal volumes, paged like
// ListVolumes over the abnormal ones: a page reads the cluster's volumes
// until it has max_entries of them, or the last.
func (c *controllerServer) ControllerListVolumeHealth(ctx context.Context, req *csipb.ControllerListVolumeHealthRequest) (*csipb.ControllerListVolumeHealthResponse, error) {
	l := listing[*storpb.Volume, *csipb.VolumeHealth]{
		kind: listHealth, list: c.listVolumes, id: (*storpb.Volume).GetId, sparse: true,
		entry: func(v *storpb.Volume) (*csipb.VolumeHealth, bool) {
			h := health(v)
			return h, len(h.GetHealthStatuses()) > 0
		},
	}
	entries, next, err := l.page(ctx, c, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	return &csipb.ControllerListVolumeHealthResponse{Entries: entries, NextToken: next}, nil
}

// GetCapacity answers what a claim from the given topology segment can
// really get: csi-provisioner (--enable-capacity) calls it once per
// segment its nodes report and per StorageClass, and the scheduler rejects
// a node whose segment's maximum_volume_size is below the claim. So it is
// computed over the servers a CreateVolume for that claim could place
// replicas on: up servers, in the zones capacityZones gives (a node
// segment never restricts placement, it is a preference; a zone restricts
// to the zones the provisioner's requisite would hold), with the
// StorageClass's replica count. See capacity for the two numbers.
func (c *controllerServer) GetCapacity(ctx context.Context, req *csipb.GetCapacityRequest) (*csipb.GetCapacityResponse, error) {
	if len(req.GetVolumeCapabilities()) > 0 {
		if err := checkCaps(req.GetVolumeCapabilities()); err != nil {
			return &csipb.GetCapacityResponse{}, nil
		}
	}
	params, err := parseParams(req.GetParameters())
	if err != nil {
		return nil, err
	}
	var zone string
	var hasZone bool
	if t := req.GetAccessibleTopology(); t != nil {
		seg, err := c.d.toStorTopology([]*csipb.Topology{t})
		if err != nil {
			return nil, err
		}
		zone, hasZone = seg[0].Segments["zone"]
	}
	cctx, cancel := c.d.call(ctx)
	defer cancel()
	var nodes []*storpb.Node
	if hasZone {
		var err error
		nodes, err = c.allNodes(cctx)
		switch {
		case clusterCode(err) == codes.Unimplemented:
			// A cluster older than the node registry: the zones the
			// nodes report are unknown, and non-strict topology puts
			// every one of them in the requisite.
			hasZone = false
		case err != nil:
			return nil, err
		}
	}
	zones, all := capacityZones(zone, hasZone, nodes)
	resp, err := c.d.cfg.Cluster.Cluster.ListServers(cctx, &storpb.ListServersRequest{})
	if err != nil {
		return nil, err
	}
	var free []uint64
	for _, s := range resp.GetServers() {
		if s.GetState() == storpb.ServerState_SERVER_STATE_UP && !s.GetCordoned() && (all || zones[s.GetZone()]) {
			free = append(free, serverFree(s, resp.GetOverProvisioningPercent()))
		}
	}
	avail, maxSize := capacity(free, int(params.replicas))
	return &csipb.GetCapacityResponse{
		AvailableCapacity: int64(avail),
		MaximumVolumeSize: wrapperspb.Int64(int64(maxSize)),
	}, nil
}

func (c *controllerServer) ControllerExpandVolume(ctx context.Context, req *csipb.ControllerExpandVolumeRequest) (*csipb.ControllerExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	if id == "" {
		return nil, invalidf("ControllerExpandVolume: no volume id")
	}
	if req.GetCapacityRange() == nil {
		return nil, invalidf("ControllerExpandVolume: no capacity range")
	}
	if req.GetVolumeCapability() != nil {
		if err := checkCap(req.GetVolumeCapability()); err != nil {
			return nil, err
		}
	}
	size, err := roundSize(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	unlock, err := c.d.locks.lock("vol/" + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	v, err := c.getVolume(ctx, id)
	if err != nil {
		return nil, err
	}
	if size < v.GetSizeBytes() {
		// Never shrink: a smaller request is satisfied by the current size
		// if the range allows it.
		if lim := req.GetCapacityRange().GetLimitBytes(); lim > 0 && uint64(lim) < v.GetSizeBytes() {
			return nil, fmt.Errorf("%w: volume %q is %d bytes; it cannot shrink to the limit %d", ErrOutOfRange, id, v.GetSizeBytes(), lim)
		}
		size = v.GetSizeBytes()
	}
	cctx, cancel := c.d.call(ctx)
	defer cancel()
	resp, err := c.d.cfg.Cluster.Volumes.ExpandVolume(cctx, &storpb.ExpandVolumeRequest{Volume: &storpb.VolumeRef{Id: id}, SizeBytes: size})
	if err != nil {
		return nil, err
	}
	_, block := req.GetVolumeCapability().GetAccessType().(*csipb.VolumeCapability_Block)
	return &csipb.ControllerExpandVolumeResponse{
		CapacityBytes:         int64(resp.GetVolume().GetSizeBytes()),
		NodeExpansionRequired: !block,
	}, nil
}

func csiSnapshot(s *storpb.Snapshot) *csipb.Snapshot {
	return &csipb.Snapshot{
		SnapshotId: s.GetId(), SourceVolumeId: s.GetVolumeId(), SizeBytes: int64(s.GetSizeBytes()),
		CreationTime: timestamppb.New(time.Unix(0, s.GetCreatedUnixNano())), ReadyToUse: s.GetReadyToUse(),
	}
}

// CreateSnapshot asks the cluster for a snapshot; of an attached volume
// the cluster has the engine cut every replica at one point
// (crash-consistent). It returns once the snapshot is cut (ready_to_use:
// every replica has cut it or is recorded as having missed it), as the CSI
// spec requires: the CO thaws the application when it returns, and a
// write acknowledged after that must not be in the snapshot. The cluster
// records the snapshot first and the replicas cut it after (the engine
// when it learns of it; the servers for a detached volume), so the call
// waits.
//
// Two ends are not a cut. A snapshot that failed (no replica could cut
// it) is deleted and the call is INTERNAL, a final error: the CO records
// it and may call again for a new one, and no record is left behind that
// no VolumeSnapshotContent names. A snapshot still not cut when the
// call's time is nearly up (an attached volume whose engine is gone: a
// dead node) is answered with ready_to_use false, as before this wait:
// an error would keep csi-snapshotter from deleting the VolumeSnapshot
// until the cut, and a volume on a dead node may never be cut; with no
// engine, nothing writes to it meanwhile.
func (c *controllerServer) CreateSnapshot(ctx context.Context, req *csipb.CreateSnapshotRequest) (*csipb.CreateSnapshotResponse, error) {
	switch {
	case req.GetName() == "":
		return nil, invalidf("CreateSnapshot: no name")
	case req.GetSourceVolumeId() == "":
		return nil, invalidf("CreateSnapshot: no source volume id")
	}
	unlock, err := c.d.locks.lock("snapname/" + req.GetName())
	if err != nil {
		return nil, err
	}
	defer unlock()
	// An existing name for another volume is ALREADY_EXISTS even when
	// the named source does not exist.
	cctx, cancel := c.d.call(ctx)
	got, err := c.d.cfg.Cluster.Snapshots.GetSnapshot(cctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Name: req.GetName()}})
	cancel()
	switch {
	case err == nil && got.GetSnapshot().GetVolumeId() != req.GetSourceVolumeId():
		return nil, fmt.Errorf("%w: snapshot %q exists for volume %q", ErrAlreadyExists, req.GetName(), got.GetSnapshot().GetVolumeId())
	case err == nil:
		return c.snapshotCut(ctx, got.GetSnapshot())
	case clusterCode(err) != codes.NotFound:
		return nil, err
	}
	if _, err := c.getVolume(ctx, req.GetSourceVolumeId()); err != nil {
		return nil, err
	}
	cctx, cancel = c.d.call(ctx)
	defer cancel()
	resp, err := c.d.cfg.Cluster.Snapshots.CreateSnapshot(cctx, &storpb.CreateSnapshotRequest{
		VolumeId: req.GetSourceVolumeId(), Name: req.GetName(),
	})
	if err != nil {
		return nil, err
	}
	return c.snapshotCut(ctx, resp.GetSnapshot())
}

// snapshotCutPoll is how often CreateSnapshot looks whether its snapshot
// is cut; snapshotCutMargin is the part of the call's time it keeps for
// its answer.
const (
	snapshotCutPoll   = 50 * time.Millisecond
	snapshotCutMargin = 2 * time.Second
)

// snapshotCut waits until snapshot s is cut (ready) or failed, and
// answers CreateSnapshot with it (see CreateSnapshot).
func (c *controllerServer) snapshotCut(ctx context.Context, taken *storpb.Snapshot) (*csipb.CreateSnapshotResponse, error) {
	s, err := c.untilCut(ctx, taken.GetId(), taken)
	switch {
	case err != nil:
		return nil, err
	case s == nil:
		return nil, notFoundf("snapshot %q: deleted while it was being taken", taken.GetName())
	case s.GetFailed():
		cctx, cancel := c.d.call(ctx)
		_, derr := c.d.cfg.Cluster.Snapshots.DeleteSnapshot(cctx, &storpb.DeleteSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: s.GetId()}})
		cancel()
		if derr != nil && clusterCode(derr) != codes.NotFound {
			c.d.log.Warn("deleting a failed snapshot", "snapshot", s.GetName(), "err", derr)
		}
		return nil, fmt.Errorf("snapshot %q of volume %q failed and was deleted: %s; call again to take another", s.GetName(), s.GetVolumeId(), s.GetStatusMessage())
	case !s.GetReadyToUse():
		c.d.log.Warn("answering CreateSnapshot with a snapshot not cut yet: is the volume's node up?", "snapshot", s.GetName(),
			"volume_id", s.GetVolumeId(), "status", s.GetStatusMessage())
	}
	return &csipb.CreateSnapshotResponse{Snapshot: csiSnapshot(s)}, nil
}

// untilCut polls snapshot id (s, if not nil, is what was last read of it)
// until it is cut (ready), failed or gone (nil, nil), or the call's time
// is nearly up (snapshotCutMargin), and returns it as last read.
func (c *controllerServer) untilCut(ctx context.Context, id string, s *storpb.Snapshot) (*storpb.Snapshot, error) {
	deadline := time.Now().Add(c.d.cfg.CallTimeout)
	if d, ok := ctx.Deadline(); ok {
		deadline = d.Add(-snapshotCutMargin)
	}
	for {
		if s != nil && (s.GetFailed() || s.GetReadyToUse() || time.Now().After(deadline)) {
			return s, nil
		}
		if s != nil {
			select {
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(snapshotCutPoll):
			}
		}
		cctx, cancel := c.d.call(ctx)
		got, err := c.d.cfg.Cluster.Snapshots.GetSnapshot(cctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: id}})
		cancel()
		if clusterCode(err) == codes.NotFound {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		s = got.GetSnapshot()
	}
}

// cloneSourceCut waits until the snapshot a clone from a volume takes of
// its source (clone v's clone_snapshot_id) is cut (see CreateVolume). A
// clone whose snapshot failed can never be filled: it is deleted and the
// call is INTERNAL; the CO calls again for a new one.
func (c *controllerServer) cloneSourceCut(ctx context.Context, v *storpb.Volume) error {
	s, err := c.untilCut(ctx, v.GetCloneSnapshotId(), nil)
	switch {
	case err != nil:
		return err
	case s == nil:
		return nil // the clone was filled from it, and dropped it
	case s.GetFailed():
		cctx, cancel := c.d.call(ctx)
		_, derr := c.d.cfg.Cluster.Volumes.DeleteVolume(cctx, &storpb.DeleteVolumeRequest{Volume: &storpb.VolumeRef{Id: v.GetId()}})
		cancel()
		if derr != nil && clusterCode(derr) != codes.NotFound {
			c.d.log.Warn("deleting a clone whose source could not be snapshotted", "volume", v.GetName(), "err", derr)
		}
		return fmt.Errorf("the snapshot of the source of clone %q failed, and the clone was deleted: %s; call again to make another", v.GetName(), s.GetStatusMessage())
	case !s.GetReadyToUse():
		c.d.log.Warn("answering CreateVolume with a clone whose source is not snapshotted yet: is the source volume's node up?", "volume", v.GetName(),
			"source_volume_id", s.GetVolumeId(), "status", s.GetStatusMessage())
	}
	return nil
}

func (c *controllerServer) DeleteSnapshot(ctx context.Context, req *csipb.DeleteSnapshotRequest) (*csipb.DeleteSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, invalidf("DeleteSnapshot: no snapshot id")
	}
	unlock, err := c.d.locks.lock("snap/" + id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	cctx, cancel := c.d.call(ctx)
	defer cancel()
	_, err = c.d.cfg.Cluster.Snapshots.DeleteSnapshot(cctx, &storpb.DeleteSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: id}})
	if err != nil && clusterCode(err) != codes.NotFound {
		return nil, err
	}
	return &csipb.DeleteSnapshotResponse{}, nil
}

func (c *controllerServer) GetSnapshot(ctx context.Context, req *csipb.GetSnapshotRequest) (*csipb.GetSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, invalidf("GetSnapshot: no snapshot id")
	}
	cctx, cancel := c.d.call(ctx)
	defer cancel()
	resp, err := c.d.cfg.Cluster.Snapshots.GetSnapshot(cctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: id}})
	if clusterCode(err) == codes.NotFound {
		return nil, notFoundf("snapshot %q", id)
	}
	if err != nil {
		return nil, err
	}
	return &csipb.GetSnapshotResponse{Snapshot: csiSnapshot(resp.GetSnapshot())}, nil
}

// ListSnapshots lists snapshots, filtered by snapshot id or source
// volume, sorted by id, paged like ListVolumes. An unknown snapshot id or
// source volume gives an empty list, as the spec asks.
func (c *controllerServer) ListSnapshots(ctx context.Context, req *csipb.ListSnapshotsRequest) (*csipb.ListSnapshotsResponse, error) {
	var filter string
	if src, id := req.GetSourceVolumeId(), req.GetSnapshotId(); src != "" || id != "" {
		filter = fmt.Sprintf("%d:%s%s", len(src), src, id) // unambiguous
	}
	l := listing[*storpb.Snapshot, *csipb.ListSnapshotsResponse_Entry]{
		kind: listSnapshots, filter: filter, id: (*storpb.Snapshot).GetId,
		entry: func(s *storpb.Snapshot) (*csipb.ListSnapshotsResponse_Entry, bool) {
			return &csipb.ListSnapshotsResponse_Entry{Snapshot: csiSnapshot(s)}, true
		},
		list: func(ctx context.Context, token string, size uint32) ([]*storpb.Snapshot, string, error) {
			resp, err := c.d.cfg.Cluster.Snapshots.ListSnapshots(ctx, &storpb.ListSnapshotsRequest{
				VolumeId: req.GetSourceVolumeId(), PageSize: size, PageToken: token,
			})
			if clusterCode(err) == codes.NotFound {
				return nil, "", nil
			}
			return resp.GetSnapshots(), resp.GetNextPageToken(), err
		},
	}
	if id := req.GetSnapshotId(); id != "" {
		l.list = func(ctx context.Context, _ string, _ uint32) ([]*storpb.Snapshot, string, error) {
			resp, err := c.d.cfg.Cluster.Snapshots.GetSnapshot(ctx, &storpb.GetSnapshotRequest{Snapshot: &storpb.SnapshotRef{Id: id}})
			switch {
			case clusterCode(err) == codes.NotFound:
				return nil, "", nil
			case err != nil:
				return nil, "", err
			case req.GetSourceVolumeId() != "" && resp.GetSnapshot().GetVolumeId() != req.GetSourceVolumeId():
				return nil, "", nil
			}
			return []*storpb.Snapshot{resp.GetSnapshot()}, "", nil
		}
	}
	entries, next, err := l.page(ctx, c, req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	return &csipb.ListSnapshotsResponse{Entries: entries, NextToken: next}, nil
}
