package servertest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"time"

	"google.golang.org/grpc"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/client"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/engine"
	"github.com/stor-io/stor/replica/localread"
	"github.com/stor-io/stor/replica/wire"
)

// Dial returns a client of the whole cluster (every node's address), as
// stor-ctl and the engine use it; closed in t.Cleanup.
func (c *Cluster) Dial() *client.Client {
	c.t.Helper()
	var addrs []string
	for _, n := range c.Nodes {
		addrs = append(addrs, n.Addr)
	}
	cl, err := client.Dial(addrs, c.dialCredentials(), grpc.WithContextDialer(c.clientDialer))
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { cl.Close() })
	return cl
}

// EngineConfig returns an engine config for a volume attached from node
// (a name, not a server), connecting to replicas over the data protocol.
func (c *Cluster) EngineConfig(volume, node string) engine.Config {
	cl := c.Dial()
	return engine.Config{
		Volume: volume, NodeID: node,
		Control:   engine.ControlPlane{Volumes: cl.Volumes, Cluster: cl.Cluster, Snapshots: cl.Snapshots},
		Connect:   engine.WireConnector(wire.ClientConfig{Dial: c.dataDial()}),
		IOTimeout: 3 * time.Second,
		Logger:    c.log.logger.With("engine", node),
	}
}

// OpenEngine opens an engine with cfg; it is closed (without detaching)
// in t.Cleanup unless the test closed it.
func (c *Cluster) OpenEngine(cfg engine.Config) *engine.Engine {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	e, err := engine.Open(ctx, cfg)
	if err != nil {
		c.t.Fatalf("servertest: open engine for %s: %v", cfg.Volume, err)
	}
	c.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		e.Close(ctx, false)
	})
	return e
}

// ReplicaDigest is one replica's content checksum.
type ReplicaDigest struct {
	Replica *storpb.Replica
	SHA256  string
	Err     error
}

// Checksums reads every replica of a volume in full over the data
// protocol, at the volume's current epoch (which fences nobody), and
// returns their SHA-256 digests.
func (c *Cluster) Checksums(volumeID string) []ReplicaDigest {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := ChecksumsWith(ctx, c.Dial(), volumeID, c.dataDial())
	if err != nil {
		c.t.Fatal(err)
	}
	return out
}

// Checksums is Cluster.Checksums for any cluster a client reaches (the
// multi-process tests use it).
func Checksums(ctx context.Context, cl *client.Client, volumeID string) ([]ReplicaDigest, error) {
	return ChecksumsWith(ctx, cl, volumeID, nil)
}

// ChecksumsWith is Checksums dialing the data ports with dial (nil:
// plaintext; a pki Dialer for a TLS cluster).
func ChecksumsWith(ctx context.Context, cl *client.Client, volumeID string, dial func(ctx context.Context, network, addr string) (net.Conn, error)) ([]ReplicaDigest, error) {
	v, err := cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: volumeID}})
	if err != nil {
		return nil, err
	}
	servers, err := cl.Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	if err != nil {
		return nil, err
	}
	addr := map[string]string{}
	for _, s := range servers.Servers {
		addr[s.Id] = s.DataAddress
	}
	var out []ReplicaDigest
	for _, r := range v.Volume.Replicas {
		d := ReplicaDigest{Replica: r}
		d.SHA256, d.Err = checksum(ctx, dial, addr[r.ServerId], v.Volume.Id, r.Id, v.Volume.Epoch, v.Volume.SizeBytes)
		out = append(out, d)
	}
	return out, nil
}

// checksum reads a replica over the data protocol for inspection (the
// cluster's servers run with InsecureDataInspect; a TLS cluster's dial
// presents an operator certificate).
func checksum(ctx context.Context, dial func(ctx context.Context, network, addr string) (net.Conn, error), addr, volumeID, replicaID string, epoch, size uint64) (string, error) {
	conn, err := wire.Dial(ctx, "tcp", addr, wire.ClientConfig{Dial: dial})
	if err != nil {
		return "", err
	}
	defer conn.Close()
	h, err := conn.OpenFor(ctx, wire.OpenRequest{Replica: replicaID, Volume: volumeID, Epoch: epoch, Purpose: wire.PurposeInspect})
	if err != nil {
		return "", err
	}
	defer h.Close(ctx)
	sum := sha256.New()
	buf := make([]byte, 1<<20)
	for off := uint64(0); off < size; off += uint64(len(buf)) {
		p := buf[:min(uint64(len(buf)), size-off)]
		if err := h.ReadAt(ctx, replica.Op{Epoch: epoch}, p, int64(off)); err != nil {
			return "", fmt.Errorf("read %s at %d: %w", replicaID, off, err)
		}
		sum.Write(p)
	}
	return hex.EncodeToString(sum.Sum(nil)), nil
}

// ReadSnapshot reads snapshot layer layer (replica.LayerName of the
// snapshot and its cut epoch) in full from replica replicaID of volume
// volumeID over the data protocol (the snapshot read path), at the
// volume's current epoch: size bytes (the snapshot's size). It does not
// consult the snapshot's record: a layer that is gone is an error wrapping
// replica.ErrNotFound.
func (c *Cluster) ReadSnapshot(volumeID, layer, replicaID string, size uint64) ([]byte, error) {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cl := c.Dial()
	v, err := cl.Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: volumeID}})
	if err != nil {
		return nil, err
	}
	servers, err := cl.Cluster.ListServers(ctx, &storpb.ListServersRequest{})
	if err != nil {
		return nil, err
	}
	var addr string
	for _, r := range v.Volume.Replicas {
		for _, srv := range servers.Servers {
			if r.Id == replicaID && srv.Id == r.ServerId {
				addr = srv.DataAddress
			}
		}
	}
	if addr == "" {
		return nil, fmt.Errorf("servertest: volume %s has no replica %s", volumeID, replicaID)
	}
	conn, err := wire.Dial(ctx, "tcp", addr, wire.ClientConfig{Dial: c.dataDial()})
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	h, err := conn.OpenFor(ctx, wire.OpenRequest{Replica: replicaID, Volume: volumeID, Epoch: v.Volume.Epoch, Purpose: wire.PurposeInspect})
	if err != nil {
		return nil, err
	}
	defer h.Close(ctx)
	out := make([]byte, size)
	for off := uint64(0); off < size; off += replica.MaxIO {
		p := out[off:min(size, off+replica.MaxIO)]
		if err := h.ReadSnapshotAt(ctx, replica.Op{Epoch: v.Volume.Epoch}, layer, p, int64(off)); err != nil {
			return nil, fmt.Errorf("read snapshot layer %s of %s at %d: %w", layer, replicaID, off, err)
		}
	}
	return out, nil
}

// Digest is the SHA-256 of p in the form Checksums reports.
func Digest(p []byte) string {
	sum := sha256.Sum256(p)
	return hex.EncodeToString(sum[:])
}

// LocalReaders dials the short-circuit read sockets of the given nodes
// (Options.LocalSockets), as an engine on their host would.
func (c *Cluster) LocalReaders(nodes ...int) []engine.LocalReader {
	c.t.Helper()
	var clients []*localread.Client
	for _, i := range nodes {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		cl, err := localread.Dial(ctx, c.Nodes[i].LocalSocket)
		cancel()
		if err != nil {
			c.t.Fatalf("servertest: dial %s's local socket: %v", c.Nodes[i].ID, err)
		}
		clients = append(clients, cl)
	}
	return engine.LocalReadersOf(clients...)
}
