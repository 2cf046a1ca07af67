package server

import (
	"context"
	"errors"
	"fmt"
	"net/url"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/raftstore"
)

// Authorisation of the control API, when the server runs with TLS: the
// caller is the identity in its client certificate (package pki), and
// accessTable says, per method, which roles may call it and what each must
// satisfy. Without TLS there is no identity and every call is allowed (the
// --insecure and default-off modes).
//
// A follower forwards a call to the leader under its own certificate and
// names the original caller in the callerKey metadata; the leader believes
// that name only from a server certificate, and authorises the call again
// for the caller, against its own (current) state. The checks on a
// follower read its local state, which may lag: the leader's check is the
// one that decides a forwarded call.

// callerKey names, on a forwarded call, the identity of the client that made
// it (stor://role/name).
const callerKey = "stor-caller"

// Sentinel errors of authorisation (codes.Unauthenticated and
// codes.PermissionDenied in codeTable).
var (
	// ErrUnauthenticated: a TLS server got a call with no verified
	// certificate.
	ErrUnauthenticated = errors.New("server: no verified client certificate")
	// ErrPermissionDenied: the caller's identity may not make this call.
	ErrPermissionDenied = errors.New("server: permission denied")
)

// check is a per-request condition on a role: nil error allows the call.
type check func(s *Server, id pki.Identity, req any) error

// access is one method's row of accessTable: the roles allowed, each with
// an optional check (nil: any request), and whether the call changes state
// (then it is audit-logged).
type access struct {
	roles   map[pki.Role]check
	mutates bool
}

var (
	any_ check = nil
	// selfServer: a server speaks only for itself.
	selfServer check = func(_ *Server, id pki.Identity, req any) error {
		var named string
		switch r := req.(type) {
		case *storpb.JoinRequest:
			named = r.GetServer().GetId()
		case *storpb.HeartbeatRequest:
			named = r.GetServer().GetId()
		}
		if named != id.Name {
			return fmt.Errorf("%w: %s may not speak for server %q", ErrPermissionDenied, id, named)
		}
		return nil
	}
	// selfNode: a CSI node registers only itself.
	selfNode check = func(_ *Server, id pki.Identity, req any) error {
		if n := req.(*storpb.RegisterNodeRequest).GetNode().GetId(); n != id.Name {
			return fmt.Errorf("%w: %s may not register node %q", ErrPermissionDenied, id, n)
		}
		return nil
	}
	// nodeAttach: a CSI node only re-attaches, at a new epoch, a volume
	// ControllerPublish attached to it (require_attached), never takes one
	// over.
	nodeAttach check = func(_ *Server, id pki.Identity, req any) error {
		r := req.(*storpb.AttachVolumeRequest)
		if r.NodeId != id.Name || !r.RequireAttached || r.Takeover {
			return fmt.Errorf("%w: %s may attach only volumes already attached to it (require_attached, no takeover), not to node %q", ErrPermissionDenied, id, r.NodeId)
		}
		return nil
	}
	// nodeDetach: a CSI node detaches only from itself.
	nodeDetach check = func(_ *Server, id pki.Identity, req any) error {
		r := req.(*storpb.DetachVolumeRequest)
		if r.NodeId != id.Name || r.FenceDetached {
			return fmt.Errorf("%w: %s may detach only volumes attached to it, not from node %q", ErrPermissionDenied, id, r.NodeId)
		}
		return nil
	}
	// nodeReplicaState: a CSI node's engine reports on replicas of volumes
	// attached to it.
	nodeReplicaState check = func(s *Server, id pki.Identity, req any) error {
		return s.attachedTo(id, req.(*storpb.SetReplicaStateRequest).VolumeId)
	}
	// nodeSnapshotCut: a CSI node's engine records cuts of snapshots of
	// volumes attached to it.
	nodeSnapshotCut check = func(s *Server, id pki.Identity, req any) error {
		if !s.store.IsLeader() {
			return nil // see attachedTo
		}
		var volumeID string
		err := s.store.View(func(r *raftstore.Reader) error {
			snap, err := r.Snapshot(req.(*storpb.RecordSnapshotCutRequest).SnapshotId)
			if err != nil {
				return err
			}
			volumeID = snap.VolumeId
			return nil
		})
		if err != nil {
			return err
		}
		return s.attachedTo(id, volumeID)
	}
)

// roles builds a row's role map: every role given (as role, check pairs
// flattened by the helpers below) plus the operator, who may call
// everything.
func roles(pairs ...any) map[pki.Role]check {
	m := map[pki.Role]check{pki.RoleOperator: nil}
	for i := 0; i < len(pairs); i += 2 {
		c, _ := pairs[i+1].(check)
		m[pairs[i].(pki.Role)] = c
	}
	return m
}

const (
	server     = pki.RoleServer
	controller = pki.RoleCSIController
	node       = pki.RoleCSINode
	bootstrap  = pki.RoleCSINodeBootstrap
)

// accessTable: method -> who may call it. A method not listed is the
// operator's only.
var accessTable = map[string]access{
	healthpb.Health_Check_FullMethodName: {roles: roles(server, any_, controller, any_, node, any_)},

	storpb.ClusterService_Status_FullMethodName:           {roles: roles(server, any_, controller, any_, node, any_)},
	storpb.ClusterService_ListServers_FullMethodName:      {roles: roles(server, any_, controller, any_, node, any_)},
	storpb.ClusterService_GetNode_FullMethodName:          {roles: roles(server, any_, controller, any_, node, any_)},
	storpb.ClusterService_ListNodes_FullMethodName:        {roles: roles(server, any_, controller, any_)},
	storpb.ClusterService_GetClusterConfig_FullMethodName: {roles: roles(server, any_, controller, any_, node, any_)},
	storpb.ClusterService_ListEvents_FullMethodName:       {roles: roles(server, any_, controller, any_)},
	storpb.ClusterService_Join_FullMethodName:             {roles: roles(server, selfServer), mutates: true},
	storpb.ClusterService_Heartbeat_FullMethodName:        {roles: roles(server, selfServer), mutates: true},
	storpb.ClusterService_RegisterNode_FullMethodName:     {roles: roles(node, selfNode), mutates: true},
	storpb.ClusterService_Leave_FullMethodName:            {roles: roles(), mutates: true},
	// The bootstrap role may make this call and no other (its only row);
	// a node renews, for itself only (nodecert.go).
	storpb.ClusterService_IssueNodeCertificate_FullMethodName: {roles: roles(bootstrap, any_, node, any_), mutates: true},

	storpb.VolumeService_GetVolume_FullMethodName:         {roles: roles(server, any_, controller, any_, node, any_)},
	storpb.VolumeService_ListVolumes_FullMethodName:       {roles: roles(server, any_, controller, any_)},
	storpb.VolumeService_WatchVolume_FullMethodName:       {roles: roles(server, any_, controller, any_, node, any_)},
	storpb.VolumeService_CreateVolume_FullMethodName:      {roles: roles(controller, any_), mutates: true},
	storpb.VolumeService_DeleteVolume_FullMethodName:      {roles: roles(controller, any_), mutates: true},
	storpb.VolumeService_ExpandVolume_FullMethodName:      {roles: roles(controller, any_), mutates: true},
	storpb.VolumeService_AttachVolume_FullMethodName:      {roles: roles(server, any_, controller, any_, node, nodeAttach), mutates: true},
	storpb.VolumeService_DetachVolume_FullMethodName:      {roles: roles(server, any_, controller, any_, node, nodeDetach), mutates: true},
	storpb.VolumeService_SetReplicaState_FullMethodName:   {roles: roles(server, any_, node, nodeReplicaState), mutates: true},
	storpb.VolumeService_ReplaceReplica_FullMethodName:    {roles: roles(), mutates: true},
	storpb.VolumeService_RecordCloneCopied_FullMethodName: {roles: roles(server, any_), mutates: true},

	storpb.SnapshotService_GetSnapshot_FullMethodName:       {roles: roles(server, any_, controller, any_, node, any_)},
	storpb.SnapshotService_ListSnapshots_FullMethodName:     {roles: roles(server, any_, controller, any_, node, any_)},
	storpb.SnapshotService_CreateSnapshot_FullMethodName:    {roles: roles(controller, any_), mutates: true},
	storpb.SnapshotService_DeleteSnapshot_FullMethodName:    {roles: roles(controller, any_), mutates: true},
	storpb.SnapshotService_RecordSnapshotCut_FullMethodName: {roles: roles(server, any_, node, nodeSnapshotCut), mutates: true},
}

// attachedTo refuses unless volume volumeID is attached to the CSI node id
// names. Only the leader decides: a follower's view may lag behind the
// attach, and it forwards the call (with the caller) to the leader, which
// checks again.
func (s *Server) attachedTo(id pki.Identity, volumeID string) error {
	if !s.store.IsLeader() {
		return nil
	}
	var attached string
	err := s.store.View(func(r *raftstore.Reader) error {
		v, err := r.Volume(volumeID)
		if err != nil {
			return err
		}
		attached = v.GetAttachment().GetNodeId()
		return nil
	})
	if err != nil {
		return err
	}
	if attached != id.Name {
		return fmt.Errorf("%w: volume %s is not attached to %s", ErrPermissionDenied, volumeID, id)
	}
	return nil
}

// callerCtxKey carries the authorised caller from authorize to the
// forwarder.
type callerCtxKey struct{}

// callerOf is the authorised caller of a call (ok false without TLS).
func callerOf(ctx context.Context) (pki.Identity, bool) {
	id, ok := ctx.Value(callerCtxKey{}).(pki.Identity)
	return id, ok
}

// caller returns the identity a call is made by: the peer's certificate,
// or, from a server, the caller it forwards for; forwarded reports the
// latter.
func caller(ctx context.Context) (id pki.Identity, forwarded bool, err error) {
	peer, err := pki.PeerOf(ctx)
	if err != nil {
		return pki.Identity{}, false, fmt.Errorf("%w: %v", ErrUnauthenticated, err)
	}
	if peer.Role != pki.RoleServer {
		return peer, false, nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	names := md.Get(callerKey)
	switch len(names) {
	case 0:
		return peer, false, nil
	case 1:
		u, err := url.Parse(names[0])
		if err != nil {
			return pki.Identity{}, false, fmt.Errorf("%w: %s forwards for %q: %v", ErrUnauthenticated, peer, names[0], err)
		}
		orig, err := pki.ParseIdentity(u)
		if err != nil {
			return pki.Identity{}, false, fmt.Errorf("%w: %s forwards for %q: %v", ErrUnauthenticated, peer, names[0], err)
		}
		return orig, true, nil
	default:
		return pki.Identity{}, false, fmt.Errorf("%w: %s forwards for %d callers", ErrUnauthenticated, peer, len(names))
	}
}

// authorizeCall decides one call; see accessTable.
func (s *Server) authorizeCall(ctx context.Context, method string, req any) (pki.Identity, bool, error) {
	id, forwarded, err := caller(ctx)
	if err != nil {
		return id, forwarded, err
	}
	row, ok := accessTable[method]
	if !ok {
		row = access{roles: roles(), mutates: true}
	}
	chk, allowed := row.roles[id.Role]
	if !allowed {
		return id, forwarded, fmt.Errorf("%w: %s may not call %s", ErrPermissionDenied, id, method)
	}
	if chk != nil && req != nil {
		if err := chk(s, id, req); err != nil {
			return id, forwarded, err
		}
	}
	return id, forwarded, nil
}

// authorize is the unary interceptor: refuses what accessTable does not
// allow, passes the caller on to the forwarder, and audit-logs every
// mutating call (but heartbeats) where it enters the cluster.
func (s *Server) authorize(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if s.cfg.TLS == nil {
		return handler(ctx, req)
	}
	id, forwarded, err := s.authorizeCall(ctx, info.FullMethod, req)
	row, listed := accessTable[info.FullMethod]
	if err != nil {
		s.logger.Warn("refused", "method", info.FullMethod, "identity", id.String(), "err", err)
		return nil, toStatus(err)
	}
	resp, err := handler(context.WithValue(ctx, callerCtxKey{}, id), req)
	if (row.mutates || !listed) && !forwarded && info.FullMethod != storpb.ClusterService_Heartbeat_FullMethodName {
		s.logger.Info("audit", "method", info.FullMethod, "identity", id.String(), "code", status.Code(err).String())
	}
	return resp, err
}

// authorizeStream is authorize for streams (WatchVolume): roles only.
func (s *Server) authorizeStream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if s.cfg.TLS == nil {
		return handler(srv, ss)
	}
	if id, _, err := s.authorizeCall(ss.Context(), info.FullMethod, nil); err != nil {
		s.logger.Warn("refused", "method", info.FullMethod, "identity", id.String(), "err", err)
		return toStatus(err)
	}
	return handler(srv, ss)
}
