package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"regexp"
	"strconv"
	"time"

	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/raftstore"
	"github.com/stor-io/stor/replica"
	"github.com/stor-io/stor/replica/wire"
)

// Config is everything a stor-server needs. DefaultConfig gives a
// one-server cluster on loopback in ./stor-data.
type Config struct {
	// ID is the server's stable id. Default: the host name (in a
	// StatefulSet, the pod name, e.g. stor-server-2).
	ID string
	// DataDir holds the Raft log, snapshots, metadata and (later) replica
	// data. Default ./stor-data.
	DataDir string
	// Listen is the control gRPC address. Default 127.0.0.1:7400.
	Listen string
	// RaftListen is the Raft transport address. Default 127.0.0.1:7401.
	RaftListen string
	// DataListen is the replica data service address. Default
	// 127.0.0.1:7402.
	DataListen string
	// Advertise is the control address other servers and clients dial.
	// Default: the address Listen bound.
	Advertise string
	// RaftAdvertise is the Raft address other servers dial. Default: the
	// address RaftListen bound.
	RaftAdvertise string
	// DataAdvertise is the data address engines and other servers dial.
	// Default: the address DataListen bound.
	DataAdvertise string
	// LocalSocket, if set, is a unix socket (mode 0600) on which volume
	// engines on this host obtain short-circuit reads of this server's
	// replicas (replica/localread). Default: none.
	LocalSocket string
	// Join lists control addresses of existing members. Empty: bootstrap a
	// new cluster when the data dir is new. Not empty: join through them,
	// except that an ID ending in -0 (StatefulSet ordinal 0) bootstraps;
	// see ShouldBootstrap.
	Join []string
	// Zone and Labels describe where the server is, for placement.
	Zone   string
	Labels map[string]string
	// KubernetesNode is the Kubernetes node the server runs on (deploy/
	// passes the pod's spec.nodeName). Placement's "node" segment, which
	// CSI fills with the pod's selected node, matches it, so a volume gets
	// a replica on the server of the node that uses it. Default "": not
	// in Kubernetes (only the id matches).
	KubernetesNode string
	// Capacity is the bytes replicas may be promised here. Default 0: the
	// size of the filesystem holding DataDir.
	Capacity uint64
	// DefaultReplicas is the replica count of a volume created with 0.
	// Default 3.
	DefaultReplicas uint32
	// HeartbeatInterval is how often the server reports to the leader.
	// Default 1s.
	HeartbeatInterval time.Duration
	// ShutdownTimeout bounds a graceful shutdown (leadership transfer and
	// draining RPCs). Default 10s.
	ShutdownTimeout time.Duration
	// TaskIOTimeout bounds each request the server's own tasks make of a
	// source replica (the rebuild of a detached volume's replica, a
	// clone's copy): a source that takes a request and never answers (its
	// disk hangs) fails the attempt, and the next attempt reads another.
	// The server's own replica, the one filled, is waited for. Default 30s.
	TaskIOTimeout time.Duration
	// API bounds the control API's connections, calls and messages. Zero
	// fields take DefaultAPILimits()'s values.
	API APILimits
	// Data tunes the replica data service: its connection cap, payload
	// memory budget and timeouts. Logger is filled in; zero fields take
	// wire.DefaultServerConfig()'s values (4096 connections, 512 MiB of
	// payload memory: deploy/ gives stor-server 2 GiB).
	Data wire.ServerConfig
	// Raft tunes the metadata store; ID, Dir, addresses, Dial and Logger
	// are filled in from the fields above, and zero fields take
	// raftstore.DefaultConfig()'s values.
	Raft raftstore.Config

	// MetricsListen is the address of the HTTP listener serving /metrics
	// (Prometheus), /healthz and /readyz (package metrics). Default "":
	// none. It is plain HTTP without authentication, unlike every other
	// port, so it is opt-in; deploy/ sets it for the kubelet's probes and
	// Prometheus.
	MetricsListen string
	// MetricsListener, if set, is used instead of binding MetricsListen.
	MetricsListener net.Listener

	// Listener, RaftListener and DataListener, if set, are used instead of
	// binding Listen, RaftListen and DataListen (tests pass pre-bound
	// listeners).
	Listener, RaftListener, DataListener net.Listener
	// Dial opens every server-to-server connection (Raft, forwarding,
	// joins, heartbeats). Default net.Dialer. Tests inject partitions here.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// ReplicaFS is the filesystem under the replica store. Default the
	// operating system's. Tests inject disk errors here (replica/errorfs).
	ReplicaFS replica.FS
	// DataIdentify tells the replica data service who the peer of a
	// connection is (wire.ServerConfig.Identify; the TLS layer fills it
	// from the client certificate). Default nil: every peer is
	// unverified, and only the metadata is enforced (dataauth.go).
	DataIdentify func(net.Conn) wire.Identity
	// InsecureDataInspect lets an unverified peer open any replica for
	// inspection (read-only, at the committed epoch): test harnesses that
	// compare replicas' bytes. Default false; never set in a deployment.
	InsecureDataInspect bool
	// Logger receives structured logs. Default slog.Default().
	Logger *slog.Logger

	// TLS, if set, secures every port with mutual TLS (package pki): the
	// control API admits every role (what each may call: authz.go's
	// accessTable), the Raft port only servers, the data port servers, CSI
	// nodes and operators; and every connection this server makes presents
	// its certificate and wants a server's. Its identity must be
	// stor://server/<ID>. A server needs TLS or Insecure.
	TLS *pki.Source
	// NodeCerts lets this server issue CSI node plugins their certificates
	// (ClusterService.IssueNodeCertificate, nodecert.go); it needs TLS.
	// Default: no issuing CA, and the call answers FailedPrecondition.
	NodeCerts NodeCertConfig
	// Insecure states that the server runs without TLS on purpose; then
	// every address (listen, advertise, join) must be on loopback. With
	// neither TLS nor Insecure the server does not start
	// (ErrNoCertificates): an unauthenticated port is never the default.
	Insecure bool
}

// APILimits bounds what clients of the control API can make a server
// hold. Every field's zero value takes DefaultAPILimits()'s.
type APILimits struct {
	// MaxConns bounds the connections served at once; further ones wait
	// in the listen backlog until one closes. Default 1024.
	MaxConns int
	// MaxConcurrentStreams bounds the calls one connection has in flight
	// (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS). Default 128.
	MaxConcurrentStreams uint32
	// MaxRecvMsgSize bounds one request message; a larger one fails with
	// ResourceExhausted. Default 4 MiB.
	MaxRecvMsgSize int
	// KeepaliveMinTime is the shortest interval between a client's pings
	// the server tolerates (pings with no call in flight included); a
	// client that pings more often is disconnected. Default 10s (grpc-go
	// clients never ping more often), and at most 10s: stor's own clients
	// and servers ping every 10s while a call is in flight, to find a path
	// that passes nothing (internal/client, forward.go).
	KeepaliveMinTime time.Duration
	// MaxConnectionIdle closes a connection with no call in flight for
	// this long (gRPC clients reconnect by themselves). Default 15m.
	MaxConnectionIdle time.Duration
	// ConnectionTimeout bounds a new connection's handshake. Default 10s.
	ConnectionTimeout time.Duration
	// DefaultPageSize is the page of ListVolumes, ListSnapshots and
	// ListNodes when the request asks for 0. Default 100.
	DefaultPageSize int
	// MaxPageSize cuts a larger page size asked for. Default 1000.
	MaxPageSize int
	// MaxPageBytes ends a page before the entry that would take its
	// encoded entries past it (a page holds at least one entry), so a
	// listing never nears a client's message size limit (gRPC's default:
	// 4 MiB). Default 1 MiB.
	MaxPageBytes int
}

// maxKeepaliveMinTime is the longest APILimits.KeepaliveMinTime: the
// keepalive interval of stor's own gRPC clients (peerKeepalive).
const maxKeepaliveMinTime = 10 * time.Second

// DefaultAPILimits returns the defaults documented on APILimits.
func DefaultAPILimits() APILimits {
	return APILimits{
		MaxConns:             1024,
		MaxConcurrentStreams: 128,
		MaxRecvMsgSize:       4 << 20,
		KeepaliveMinTime:     10 * time.Second,
		MaxConnectionIdle:    15 * time.Minute,
		ConnectionTimeout:    10 * time.Second,
		DefaultPageSize:      100,
		MaxPageSize:          1000,
		MaxPageBytes:         1 << 20,
	}
}

func (l *APILimits) withDefaults() {
	d := DefaultAPILimits()
	if l.MaxConns == 0 {
		l.MaxConns = d.MaxConns
	}
	if l.MaxConcurrentStreams == 0 {
		l.MaxConcurrentStreams = d.MaxConcurrentStreams
	}
	if l.MaxRecvMsgSize == 0 {
		l.MaxRecvMsgSize = d.MaxRecvMsgSize
	}
	if l.KeepaliveMinTime == 0 {
		l.KeepaliveMinTime = d.KeepaliveMinTime
	}
	if l.MaxConnectionIdle == 0 {
		l.MaxConnectionIdle = d.MaxConnectionIdle
	}
	if l.ConnectionTimeout == 0 {
		l.ConnectionTimeout = d.ConnectionTimeout
	}
	if l.DefaultPageSize == 0 {
		l.DefaultPageSize = d.DefaultPageSize
	}
	if l.MaxPageSize == 0 {
		l.MaxPageSize = d.MaxPageSize
	}
	if l.MaxPageBytes == 0 {
		l.MaxPageBytes = d.MaxPageBytes
	}
}

// DefaultConfig returns the defaults documented on Config.
func DefaultConfig() Config {
	host, _ := os.Hostname()
	return Config{
		ID:                host,
		DataDir:           "./stor-data",
		Listen:            "127.0.0.1:7400",
		RaftListen:        "127.0.0.1:7401",
		DataListen:        "127.0.0.1:7402",
		DefaultReplicas:   3,
		HeartbeatInterval: time.Second,
		ShutdownTimeout:   10 * time.Second,
		TaskIOTimeout:     30 * time.Second,
		API:               DefaultAPILimits(),
		Data:              wire.DefaultServerConfig(),
		Raft:              raftstore.DefaultConfig(),
	}
}

// withDefaults fills zero tuning fields (not the addresses or the id:
// those an embedding caller sets on purpose).
func (c *Config) withDefaults() {
	d := DefaultConfig()
	if c.DefaultReplicas == 0 {
		c.DefaultReplicas = d.DefaultReplicas
	}
	if c.HeartbeatInterval == 0 {
		c.HeartbeatInterval = d.HeartbeatInterval
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = d.ShutdownTimeout
	}
	if c.TaskIOTimeout == 0 {
		c.TaskIOTimeout = d.TaskIOTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	c.API.withDefaults()
	c.NodeCerts.withDefaults()
	if c.ReplicaFS == nil && jepsenReplicaFS != nil {
		c.ReplicaFS = jepsenReplicaFS(c.Logger)
	}
	if jepsenDataConfig != nil {
		jepsenDataConfig(&c.Data)
	}
	if c.Dial == nil {
		var dialer net.Dialer
		c.Dial = dialer.DialContext
	}
}

// Validate reports the first problem with the configuration.
func (c *Config) Validate() error {
	switch {
	case !raftstore.ValidID(c.ID):
		return fmt.Errorf("server: --id %q: use 1-63 letters, digits, '.', '_' or '-'", c.ID)
	case c.DataDir == "":
		return fmt.Errorf("server: --data-dir is required")
	case c.Listener == nil && c.Listen == "":
		return fmt.Errorf("server: --listen is required")
	case c.RaftListener == nil && c.RaftListen == "":
		return fmt.Errorf("server: --raft-listen is required")
	case c.DataListener == nil && c.DataListen == "":
		return fmt.Errorf("server: --data-listen is required")
	case c.DefaultReplicas < 1 || c.DefaultReplicas > raftstore.MaxReplicas:
		return fmt.Errorf("server: default replicas %d is outside 1..%d", c.DefaultReplicas, raftstore.MaxReplicas)
	case c.HeartbeatInterval <= 0:
		return fmt.Errorf("server: heartbeat interval must be positive")
	case c.TaskIOTimeout < 0:
		return fmt.Errorf("server: task I/O timeout must not be negative")
	case c.API.MaxConns < 0 || c.API.MaxRecvMsgSize < 0 || c.API.KeepaliveMinTime < 0 ||
		c.API.MaxConnectionIdle < 0 || c.API.ConnectionTimeout < 0 ||
		c.API.DefaultPageSize < 0 || c.API.MaxPageSize < 0 || c.API.MaxPageBytes < 0:
		return fmt.Errorf("server: control API limits must not be negative")
	case c.API.KeepaliveMinTime > maxKeepaliveMinTime:
		return fmt.Errorf("server: keepalive min time %v is over %v: stor's clients and servers, which ping every %v while a call is in flight, would be disconnected", c.API.KeepaliveMinTime, maxKeepaliveMinTime, maxKeepaliveMinTime)
	}
	if err := c.Data.Validate(); err != nil {
		return fmt.Errorf("server: data service: %w", err)
	}
	for _, addr := range append([]string{c.Listen, c.RaftListen, c.DataListen, c.Advertise, c.RaftAdvertise, c.DataAdvertise, c.MetricsListen}, c.Join...) {
		if addr == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return fmt.Errorf("server: address %q: %v", addr, err)
		}
	}
	switch {
	case c.TLS != nil && c.Insecure:
		return fmt.Errorf("server: --insecure with TLS certificates")
	case c.TLS != nil && c.TLS.Identity() != (pki.Identity{Role: pki.RoleServer, Name: c.ID}):
		return fmt.Errorf("server: the TLS certificate is %s, not stor://server/%s", c.TLS.Identity(), c.ID)
	case c.TLS == nil && !c.Insecure:
		return ErrNoCertificates
	case c.Insecure:
		if err := pki.CheckLoopback(append([]string{c.Listen, c.RaftListen, c.DataListen, c.Advertise, c.RaftAdvertise, c.DataAdvertise}, c.Join...)...); err != nil {
			return fmt.Errorf("server: %w", err)
		}
	}
	if err := c.NodeCerts.validate(c.TLS); err != nil {
		return err
	}
	if c.Raft.ServerDownTimeout > 0 && c.Raft.ServerDownTimeout <= c.HeartbeatInterval {
		return fmt.Errorf("server: the server-down timeout %v must exceed the heartbeat interval %v", c.Raft.ServerDownTimeout, c.HeartbeatInterval)
	}
	return nil
}

// ErrNoCertificates: a server was given neither TLS nor Insecure.
var ErrNoCertificates = errors.New("server: no TLS certificates (--tls-cert, --tls-key and --tls-ca; make cluster makes them, cert-manager in Kubernetes) and no --insecure (plaintext, loopback addresses only)")

var ordinalPattern = regexp.MustCompile(`-(\d+)$`)

// Ordinal returns the StatefulSet ordinal at the end of id ("stor-2" -> 2).
func Ordinal(id string) (int, bool) {
	m := ordinalPattern.FindStringSubmatch(id)
	if m == nil {
		return 0, false
	}
	n, err := strconv.Atoi(m[1])
	return n, err == nil
}

// ShouldBootstrap decides, for a server with no Raft state, whether it
// starts a new cluster (true) or joins one through its seeds (false): with
// no seeds it bootstraps; with seeds, only StatefulSet ordinal 0 does. The
// ordinal is read from the id, which defaults to the host name, so in a
// StatefulSet every pod can be given the same --join list.
func ShouldBootstrap(id string, join []string) bool {
	if len(join) == 0 {
		return true
	}
	n, ok := Ordinal(id)
	return ok && n == 0
}
