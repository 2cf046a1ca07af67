package wire

import (
	"bytes"
	"context"
	"fmt"
	"net"

	"github.com/stor-io/stor/replica"
)

// Purpose says why an OPEN is made; the server's Authorizer checks it
// against the cluster's metadata (doc.go, "Authorisation").
type Purpose uint8

// The purposes. PurposeNone is an OPEN that states none (Conn.Open): a
// server with an Authorizer refuses it.
const (
	PurposeNone Purpose = iota
	// PurposeAttach: the engine of the attachment (Volume, Epoch, Node).
	PurposeAttach
	// PurposeRebuild: a server rebuilding its replica of a detached volume.
	PurposeRebuild
	// PurposeSnapshotCut: a server cutting a detached volume's pending
	// snapshots at the epoch it fenced the volume with.
	PurposeSnapshotCut
	// PurposeCloneCopy: a server filling its replica of a clone from
	// snapshot Snapshot of Volume (read-only: EXTENTS and SNAPSHOT_READ of
	// that snapshot's layer).
	PurposeCloneCopy
	// PurposeInspect: an operator reading a replica (read-only: READ,
	// EXTENTS, SNAPSHOT_READ).
	PurposeInspect
	// PurposeRebuildSource: server Node reading a healthy replica of
	// Volume as the source of the REBUILD_COPY requests its rebuilding
	// replica serves (read-only: READ), attached volume or not.
	PurposeRebuildSource
	purposeMax
)

var purposeNames = [purposeMax]string{"", "attach", "rebuild", "snapshot-cut", "clone-copy", "inspect", "rebuild-source"}

func (p Purpose) String() string {
	if p < purposeMax {
		if p == PurposeNone {
			return "none"
		}
		return purposeNames[p]
	}
	return fmt.Sprintf("purpose-%d", uint8(p))
}

// OpenRequest is what an OPEN asks for: replica Replica of volume Volume at
// epoch Epoch, for Purpose, by (or for) node or server Node; Snapshot
// names the snapshot a clone copy reads.
type OpenRequest struct {
	Replica  string
	Volume   string
	Node     string
	Snapshot string
	Epoch    uint64
	Purpose  Purpose
	// Incarnation orders an engine's attach handles of one replica (doc.go,
	// "Incarnations"): the replica's control-plane generation when the
	// engine opened it. It travels in the OPEN's generation field; 0 is
	// an OPEN that states none, older than any that does.
	Incarnation uint64
}

// openFields is how many NUL-separated fields an OPEN payload has at most.
const openFields = 5

// MaxOpenPayload bounds an OPEN request's payload.
const MaxOpenPayload = openFields*MaxIDLen + openFields - 1

// encodeOpen is an OPEN payload: replica, purpose, volume, node and
// snapshot, separated by NUL bytes. A payload of the replica id alone (no
// NUL) is an OPEN with PurposeNone.
func encodeOpen(r OpenRequest) []byte {
	if r.Purpose == PurposeNone && r.Volume == "" && r.Node == "" && r.Snapshot == "" {
		return []byte(r.Replica)
	}
	name := ""
	if r.Purpose < purposeMax {
		name = purposeNames[r.Purpose]
	}
	return []byte(r.Replica + "\x00" + name + "\x00" + r.Volume + "\x00" + r.Node + "\x00" + r.Snapshot)
}

// decodeOpen decodes an OPEN payload (encodeOpen); epoch comes from the
// header. Errors wrap replica.ErrInvalid.
func decodeOpen(p []byte, epoch uint64) (OpenRequest, error) {
	f := bytes.Split(p, []byte{0})
	if len(f) > openFields {
		return OpenRequest{}, fmt.Errorf("wire: OPEN: %d fields, want at most %d: %w", len(f), openFields, replica.ErrInvalid)
	}
	for _, s := range f {
		if len(s) > MaxIDLen {
			return OpenRequest{}, fmt.Errorf("wire: OPEN: field of %d bytes exceeds %d: %w", len(s), MaxIDLen, replica.ErrInvalid)
		}
	}
	for len(f) < openFields {
		f = append(f, nil)
	}
	r := OpenRequest{Replica: string(f[0]), Volume: string(f[2]), Node: string(f[3]), Snapshot: string(f[4]), Epoch: epoch}
	if r.Replica == "" {
		return OpenRequest{}, fmt.Errorf("wire: OPEN: empty replica id: %w", replica.ErrInvalid)
	}
	if name := string(f[1]); name != "" {
		r.Purpose = purposeMax
		for i, n := range purposeNames {
			if n == name {
				r.Purpose = Purpose(i)
			}
		}
		if r.Purpose == purposeMax {
			return OpenRequest{}, fmt.Errorf("wire: OPEN: unknown purpose %q: %w", name, replica.ErrInvalid)
		}
	}
	return r, nil
}

// Identity is who a peer proved to be. Until the data port's TLS layer
// fills it from the peer's certificate (ServerConfig.Identify), it is the
// zero Identity: not verified.
type Identity struct {
	// Verified is true only when Role and Name come from a certificate
	// the server checked.
	Verified bool
	// Role is the certificate's role: "server", "csi-node",
	// "csi-controller" or "operator".
	Role string
	// Name is the server id (role server) or Kubernetes node (csi-node)
	// the certificate was issued for.
	Name string
}

// Peer is the other end of a data connection.
type Peer struct {
	Addr     net.Addr
	Identity Identity
}

// Request is what a Grant is asked about: one request on a handle, with
// its epoch and generation. ID is the snapshot (layer) id of
// SNAPSHOT_CREATE, SNAPSHOT_DELETE, SNAPSHOT_READ and EXTENTS ("" for the
// head), and the source replica's id of REBUILD_COPY; Len is GROW's new
// size.
type Request struct {
	Op         Opcode
	Epoch      uint64
	Generation uint64
	Len        uint64
	ID         string
}

// Authorizer decides what a peer may open. Open returns the Grant kept
// with the handle, or an error (wrapping ErrDenied for a refusal, or
// replica.ErrNotFound for a replica the metadata does not know yet, which
// a client may retry). It may wait, bounded, for the server's metadata to
// catch up; ctx ends when the server closes.
type Authorizer interface {
	Open(ctx context.Context, p Peer, r OpenRequest) (Grant, error)
}

// Grant is what an opened handle may do. Allow is asked before every
// request on the handle but CLOSE, concurrently; an error (wrapping
// ErrDenied) refuses the request.
type Grant interface {
	Allow(ctx context.Context, r Request) error
}
