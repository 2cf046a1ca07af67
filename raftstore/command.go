package raftstore

import (
	"encoding/binary"
	"fmt"

	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

// op names a state machine command. Values are part of the log format:
// never renumber, only append.
type op uint8

const (
	opInitCluster     op = 1  // ID = cluster id
	opRegisterServer  op = 2  // Body = storpb.Server
	opSetServerState  op = 3  // Body = storpb.Server (id, state)
	opRemoveServer    op = 4  // ID = server id
	opCreateVolume    op = 5  // ID = new volume id, Body = storpb.CreateVolumeRequest
	opDeleteVolume    op = 6  // Body = storpb.VolumeRef
	opExpandVolume    op = 7  // Body = storpb.ExpandVolumeRequest
	opAttachVolume    op = 8  // Body = storpb.AttachVolumeRequest
	opDetachVolume    op = 9  // Body = storpb.DetachVolumeRequest
	opCreateSnapshot  op = 10 // ID = new snapshot id, Body = storpb.CreateSnapshotRequest
	opDeleteSnapshot  op = 11 // Body = storpb.SnapshotRef
	opSetReplicaState op = 12 // Body = storpb.SetReplicaStateRequest
	opReplaceReplica  op = 13 // ID = new replica id, Body = storpb.ReplaceReplicaRequest
	opRecordCut       op = 14 // Body = storpb.RecordSnapshotCutRequest
	opRecordCloneCopy op = 15 // Body = storpb.RecordCloneCopiedRequest
	opRegisterNode    op = 16 // Body = storpb.Node (id, zone, labels, max volumes)
	// opRepairReplica is opReplaceReplica proposed by the leader's repair
	// of a replica unhealthy too long: it is not refused for holding the
	// last copy of a snapshot (the loss is recorded instead).
	opRepairReplica op = 17 // ID = new replica id, Body = storpb.ReplaceReplicaRequest
	// opSetClusterConfig merges the body's non-zero fields into the
	// cluster-wide policy (clusterconfig.go).
	opSetClusterConfig op = 18 // Body = storpb.ClusterConfig
	opCordonServer     op = 19 // Body = storpb.Server (id, cordoned)
)

var opNames = map[op]string{
	opInitCluster: "init-cluster", opRegisterServer: "register-server",
	opSetServerState: "set-server-state", opRemoveServer: "remove-server",
	opCreateVolume: "create-volume", opDeleteVolume: "delete-volume",
	opExpandVolume: "expand-volume", opAttachVolume: "attach-volume",
	opDetachVolume: "detach-volume", opCreateSnapshot: "create-snapshot",
	opDeleteSnapshot: "delete-snapshot", opSetReplicaState: "set-replica-state",
	opReplaceReplica: "replace-replica", opRecordCut: "record-snapshot-cut",
	opRecordCloneCopy: "record-clone-copied", opRegisterNode: "register-node",
	opRepairReplica: "repair-replica", opSetClusterConfig: "set-cluster-config",
	opCordonServer: "cordon-server",
}

func (o op) String() string {
	if n, ok := opNames[o]; ok {
		return n
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// command is one log entry's payload. The proposer fills At (its clock) and
// ID (a fresh id for creates) so the FSM needs neither a clock nor a random
// source.
type command struct {
	Op   op
	At   int64 // unix nanoseconds, proposer's clock
	ID   string
	Body proto.Message
}

// commandVersion is the first byte of every encoded command.
const commandVersion = 1

// Encoding: version(1) op(1) at(8, big endian) idLen(uvarint) id body(rest,
// deterministic protobuf).
func (c command) encode() ([]byte, error) {
	var body []byte
	if c.Body != nil {
		var err error
		body, err = proto.MarshalOptions{Deterministic: true}.Marshal(c.Body)
		if err != nil {
			return nil, fmt.Errorf("raftstore: encode %v: %w", c.Op, err)
		}
	}
	b := make([]byte, 0, 10+binary.MaxVarintLen64+len(c.ID)+len(body))
	b = append(b, commandVersion, byte(c.Op))
	b = binary.BigEndian.AppendUint64(b, uint64(c.At))
	b = binary.AppendUvarint(b, uint64(len(c.ID)))
	b = append(b, c.ID...)
	return append(b, body...), nil
}

// decodeCommand parses an encoded command; the body is decoded into the
// message type its op expects.
func decodeCommand(b []byte) (command, error) {
	var c command
	if len(b) < 10 || b[0] != commandVersion {
		return c, fmt.Errorf("%w: command of %d bytes with version %v", ErrCorrupt, len(b), b[:min(1, len(b))])
	}
	c.Op = op(b[1])
	c.At = int64(binary.BigEndian.Uint64(b[2:10]))
	n, k := binary.Uvarint(b[10:])
	if k <= 0 || uint64(len(b)-10-k) < n {
		return c, fmt.Errorf("%w: %v command with bad id length", ErrCorrupt, c.Op)
	}
	c.ID = string(b[10+k : 10+k+int(n)])
	body := b[10+k+int(n):]
	var m proto.Message
	switch c.Op {
	case opInitCluster, opRemoveServer:
	case opRegisterServer, opSetServerState, opCordonServer:
		m = &storpb.Server{}
	case opCreateVolume:
		m = &storpb.CreateVolumeRequest{}
	case opDeleteVolume:
		m = &storpb.VolumeRef{}
	case opExpandVolume:
		m = &storpb.ExpandVolumeRequest{}
	case opAttachVolume:
		m = &storpb.AttachVolumeRequest{}
	case opDetachVolume:
		m = &storpb.DetachVolumeRequest{}
	case opCreateSnapshot:
		m = &storpb.CreateSnapshotRequest{}
	case opDeleteSnapshot:
		m = &storpb.SnapshotRef{}
	case opSetReplicaState:
		m = &storpb.SetReplicaStateRequest{}
	case opReplaceReplica, opRepairReplica:
		m = &storpb.ReplaceReplicaRequest{}
	case opRecordCut:
		m = &storpb.RecordSnapshotCutRequest{}
	case opRecordCloneCopy:
		m = &storpb.RecordCloneCopiedRequest{}
	case opRegisterNode:
		m = &storpb.Node{}
	case opSetClusterConfig:
		m = &storpb.ClusterConfig{}
	default:
		return c, fmt.Errorf("%w: unknown command %v", ErrCorrupt, c.Op)
	}
	if m != nil {
		if err := proto.Unmarshal(body, m); err != nil {
			return c, fmt.Errorf("%w: %v command body: %v", ErrCorrupt, c.Op, err)
		}
		c.Body = m
	}
	return c, nil
}
