package raftstore

import (
	"context"
	"fmt"
	"regexp"
	"strconv"

	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

// A node is a host that attaches volumes (a CSI node plugin's node id,
// normally the Kubernetes node name). It need not run a stor-server: the
// nodes bucket is independent of the servers bucket, and an id may be in
// both. The cluster never removes a node record.

// idPattern is the rule for server ids: 1-63 letters, digits, '.',
// '_' or '-', starting with a letter or digit.
var idPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

// ValidID reports whether id is a valid server id.
func ValidID(id string) bool { return idPattern.MatchString(id) }

// nodeIDPattern is the rule for node ids: as for servers, but up to 253
// characters, because a node id is normally a Kubernetes node name (a DNS
// subdomain, up to 253).
var nodeIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$`)

// ValidNodeID reports whether id is a valid node id.
func ValidNodeID(id string) bool { return nodeIDPattern.MatchString(id) }

// CheckNodeID is the one check of a node id, on every path that takes one
// (RegisterNode, GetNode, AttachVolume, DetachVolume, a server's
// Kubernetes node): ErrInvalidArgument unless ValidNodeID. what names the
// field in the error.
func CheckNodeID(what, id string) error {
	if !ValidNodeID(id) {
		return fmt.Errorf("%w: %s %s: use 1-253 letters, digits, '.', '_' or '-', starting with a letter or digit (a Kubernetes node name)",
			ErrInvalidArgument, what, QuoteID(id))
	}
	return nil
}

// CheckServerID is CheckNodeID for server ids (Join, Heartbeat, Leave,
// ReplaceReplica's target): ErrInvalidArgument unless ValidID.
func CheckServerID(what, id string) error {
	if !ValidID(id) {
		return fmt.Errorf("%w: %s %s: use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit",
			ErrInvalidArgument, what, QuoteID(id))
	}
	return nil
}

// checkServerIDs checks a server record's id and Kubernetes node (which
// may be empty: not in Kubernetes).
func checkServerIDs(srv *storpb.Server) error {
	if err := CheckServerID("server id", srv.GetId()); err != nil {
		return err
	}
	if k := srv.GetKubernetesNode(); k != "" {
		return CheckNodeID(fmt.Sprintf("server %s: Kubernetes node", srv.Id), k)
	}
	return nil
}

// maxQuotedID is how much of a rejected id an error message repeats.
const maxQuotedID = 64

// QuoteID quotes an id for an error message: Go-quoted (control
// characters escaped) and cut to its first 64 bytes, so a hostile id
// neither reaches a terminal raw nor inflates the error.
func QuoteID(id string) string {
	if len(id) > maxQuotedID {
		return strconv.Quote(id[:maxQuotedID]) + fmt.Sprintf("... (%d bytes)", len(id))
	}
	return strconv.Quote(id)
}

// Node returns the node with the given id, or ErrNotFound.
func (r *Reader) Node(id string) (*storpb.Node, error) {
	n := &storpb.Node{}
	if err := r.get(bucketNodes, id, n); err != nil {
		return nil, fmt.Errorf("node %q: %w", id, err)
	}
	return n, nil
}

// Nodes returns every registered node, ordered by id.
func (r *Reader) Nodes() ([]*storpb.Node, error) {
	out, _, err := r.ListNodes(Page{})
	return out, err
}

// ListNodes pages through the registered nodes in id order, as
// ListVolumes does.
func (r *Reader) ListNodes(p Page) ([]*storpb.Node, string, error) {
	var out []*storpb.Node
	next, err := r.page(r.tx.Bucket(bucketNodes).Cursor(), p, func(v []byte) (func(), error) {
		n := &storpb.Node{}
		if err := proto.Unmarshal(v, n); err != nil {
			return nil, fmt.Errorf("%w: node: %v", ErrCorrupt, err)
		}
		return func() { out = append(out, n) }, nil
	})
	return out, next, err
}

// registerNode records a node: an upsert by id that replaces zone, labels
// and max volumes, keeps the first registration time and stamps the
// latest.
func (w *writer) registerNode(at int64, in *storpb.Node) (proto.Message, error) {
	if err := CheckNodeID("node id", in.Id); err != nil {
		return nil, err
	}
	if err := CheckLabels(fmt.Sprintf("node %s: labels", in.Id), in.Labels); err != nil {
		return nil, err
	}
	n, err := w.Node(in.Id)
	if err != nil {
		n = &storpb.Node{Id: in.Id, RegisteredUnixNano: at}
	}
	n.Zone, n.Labels, n.MaxVolumes, n.LastRegisteredUnixNano = in.Zone, in.Labels, in.MaxVolumes, at
	w.put(bucketNodes, n.Id, n)
	return n, nil
}

// RegisterNode records a node (idempotent by id; see registerNode). A
// malformed id is ErrInvalidArgument.
func (s *Store) RegisterNode(ctx context.Context, in *storpb.Node) (*storpb.Node, error) {
	if err := CheckNodeID("node id", in.GetId()); err != nil {
		return nil, err
	}
	if in.MaxVolumes < 0 {
		return nil, fmt.Errorf("%w: node %q: max volumes %d is negative", ErrInvalidArgument, in.Id, in.MaxVolumes)
	}
	m, err := s.propose(ctx, command{Op: opRegisterNode, Body: &storpb.Node{Id: in.Id, Zone: in.Zone, Labels: in.Labels, MaxVolumes: in.MaxVolumes}})
	if err != nil {
		return nil, err
	}
	return m.(*storpb.Node), nil
}

// CordonServer sets (cordoned) or clears a server's cordon: a cordoned
// server receives no new replica; the ones it holds stay, unless drain is
// set too: then the leader moves them elsewhere (drainReplicas). Clearing
// the cordon ends a drain. An unknown server is ErrNotFound; a malformed
// id, or drain without cordoned, ErrInvalidArgument.
func (s *Store) CordonServer(ctx context.Context, id string, cordoned, drain bool) (*storpb.Server, error) {
	if err := CheckServerID("server id", id); err != nil {
		return nil, err
	}
	if drain && !cordoned {
		return nil, fmt.Errorf("%w: a drain cordons the server: drain with cordoned false", ErrInvalidArgument)
	}
	m, err := s.propose(ctx, command{Op: opCordonServer, Body: &storpb.Server{Id: id, Cordoned: cordoned, Draining: drain}})
	if err != nil {
		return nil, err
	}
	return m.(*storpb.Server), nil
}
