package server

import (
	"context"
	"errors"
	"fmt"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/raftstore"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
)

// A rebuild's target copies its chunks from the source itself when the
// rebuilder asks it to (REBUILD_COPY, replica/wire/copy.go): this server,
// as the target's, reads the source replica from its server over the data
// protocol, with its own identity and the purpose rebuild-source, which
// the source's server authorises (dataauth.go). Where the source is, and
// that it may be read, comes from this server's applied metadata, never
// from the request: the target's replica must be a rebuilding replica of
// the volume on this server, and the source a healthy replica of the same
// volume. A refusal a later entry could lift is checked again once this
// server has caught up, within the request's budget.

// newCopySources returns the data plane's wire.Sources.
func newCopySources(s *Server, a *dataAccess) *wire.Sources {
	return &wire.Sources{
		Client: wire.ClientConfig{Dial: s.dialData},
		Resolve: func(ctx context.Context, target wire.OpenRequest, source string, o replica.Op) (string, wire.OpenRequest, error) {
			var addr string
			err := a.decide(ctx, func(m metaView) error {
				var err error
				addr, err = copySourceAddress(m, s.cfg.ID, target, source)
				return err
			})
			return addr, wire.OpenRequest{
				Replica: source, Volume: target.Volume, Node: s.cfg.ID, Epoch: o.Epoch, Purpose: wire.PurposeRebuildSource,
			}, err
		},
	}
}

// copySourceAddress is the data address of the server of replica source,
// if it may be the source of a copy into target's replica on server me
// (a healthy replica; of a clone being filled, a filled one: rebuildSource).
func copySourceAddress(m metaView, me string, target wire.OpenRequest, source string) (string, error) {
	v, err := m.Volume(target.Volume)
	if errors.Is(err, raftstore.ErrNotFound) {
		return "", lagging("copy into %s: volume %s not found", target.Replica, target.Volume)
	} else if err != nil {
		return "", err
	}
	dst := replicaOf(v, target.Replica)
	if dst == nil || dst.ServerId != me || dst.State != storpb.ReplicaState_REPLICA_STATE_REBUILDING {
		return "", lagging("copy into %s: not a rebuilding replica of volume %s on this server", target.Replica, v.Name)
	}
	src := replicaOf(v, source)
	if src == nil || !rebuildSource(v, src) {
		return "", lagging("copy into %s from %s: not a healthy replica of volume %s (of a clone being filled, not a filled one)", target.Replica, source, v.Name)
	}
	srv, err := m.Server(src.ServerId)
	if errors.Is(err, raftstore.ErrNotFound) {
		return "", lagging("copy into %s from %s: server %s not found", target.Replica, source, src.ServerId)
	} else if err != nil {
		return "", err
	}
	if srv.DataAddress == "" {
		return "", fmt.Errorf("server: copy into %s from %s: server %s has no data address", target.Replica, source, srv.Id)
	}
	return srv.DataAddress, nil
}
