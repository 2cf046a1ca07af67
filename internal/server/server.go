// Package server assembles a stor-server: the Raft metadata store, the
// control gRPC API (with leader forwarding), bootstrap or join, and the
// heartbeat that keeps the leader's liveness view current, and, given an
// issuing CA, the certificates of CSI node plugins (nodecert.go).
// cmd/stor-server is a thin main over it, and tests start the same Server
// in-process.
package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/net/netutil"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/metrics"
	"github.com/stor-io/stor/internal/pki"
	"github.com/stor-io/stor/raftstore"
)

// Server is a running stor-server.
type Server struct {
	cfg    Config
	logger *slog.Logger
	store  *raftstore.Store
	grpc   *grpc.Server
	lis    net.Listener
	fwd    *forwarder
	data   *dataPlane

	// metrics is the registry; raftMetrics and apiMetrics the collectors
	// fed by events (apply latency, control API calls); metricsSrv the
	// listener of Config.MetricsListen, nil when none (metrics.go).
	metrics     *prometheus.Registry
	raftMetrics *metrics.Raft
	apiMetrics  *metrics.RPCs
	metricsSrv  *metrics.Server
	// dialData opens connections to other servers' Raft and data ports: cfg.Dial,
	// under TLS when cfg.TLS is set.
	dialData func(ctx context.Context, network, addr string) (net.Conn, error)

	ctx    context.Context // cancelled by Close and Kill
	cancel context.CancelFunc
	wg     sync.WaitGroup // background loops and the gRPC serve goroutine

	// joining is set while joinLoop runs. dirRefused is set while the
	// leader refuses this server's join or heartbeats for its data dir
	// (raftstore.ErrDataDirReplaced): not ready; removed then, it joins
	// afresh (heartbeat). dirRefusedSaid is when that was last logged.
	// removed is set while the cluster has no record of this member.
	joining, dirRefused, removed atomic.Bool
	dirRefusedSaid               time.Time
	// otherClusterSaid is when a heartbeat refused by a server of
	// another cluster was last logged.
	otherClusterSaid time.Time
	// peerRefusals is when a call of another cluster's server was last
	// logged (peercluster.go).
	peerRefusals refusals

	closeOnce sync.Once
	closeErr  error
}

// Start validates cfg, opens the data dir, starts serving, and either
// bootstraps a new cluster or starts joining one in the background (see
// ShouldBootstrap). A data dir that belongs to another server or cluster,
// or is damaged, is refused with an error naming the problem.
func Start(cfg Config) (*Server, error) {
	cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, logger: cfg.Logger.With("server", cfg.ID), metrics: metrics.NewRegistry(), apiMetrics: metrics.NewRPCs("api")}
	s.raftMetrics = metrics.NewRaft(s.raftStatus)
	s.ctx, s.cancel = context.WithCancel(context.Background())
	if err := s.start(); err != nil {
		s.cancel()
		if s.grpc != nil {
			// Serving already: its connections too, not just the
			// listener (closed below).
			s.grpc.Stop()
		}
		if s.metricsSrv != nil {
			s.metricsSrv.Close()
		} else if cfg.MetricsListener != nil {
			cfg.MetricsListener.Close()
		}
		if s.fwd != nil {
			s.fwd.close()
		}
		if s.lis != nil {
			s.lis.Close()
		}
		if s.data != nil {
			s.data.close()
		}
		if s.store != nil {
			s.store.Close()
		}
		s.wg.Wait() // the API's Serve loop
		return nil, err
	}
	return s, nil
}

func (s *Server) start() error {
	cfg := &s.cfg
	var err error
	s.dialData = cfg.Dial
	if cfg.TLS != nil {
		s.dialData = cfg.TLS.Dialer(cfg.Dial, pki.RoleServer)
	} else {
		s.logger.Warn("no TLS: every port of this server is unauthenticated and unencrypted", "insecure", cfg.Insecure)
	}
	if cfg.NodeCerts.Enabled() && cfg.NodeCerts.Reviewer == nil {
		if cfg.NodeCerts.Reviewer, err = NewKubeTokenReviewer(cfg.NodeCerts.Kubeconfig); err != nil {
			return err
		}
	}
	s.lis = cfg.Listener
	if s.lis == nil {
		if s.lis, err = net.Listen("tcp", cfg.Listen); err != nil {
			return fmt.Errorf("server: control listen: %w", err)
		}
	}
	if cfg.Advertise == "" {
		cfg.Advertise = s.lis.Addr().String()
	}
	if err := privateDir(cfg.DataDir); err != nil {
		return err
	}
	if cfg.Capacity == 0 {
		if cfg.Capacity, err = filesystemSize(cfg.DataDir); err != nil {
			return err
		}
	}

	// A server that would bootstrap with seeds first asks them whether a
	// cluster exists already; on a data dir never used, before it writes
	// anything there, so a refused start leaves the directory as it was.
	s.fwd = &forwarder{s: s}
	bootstrap := ShouldBootstrap(cfg.ID, cfg.Join)
	asked := false
	if bootstrap && len(cfg.Join) > 0 && !raftstore.Initialized(cfg.DataDir) {
		existing, err := s.existingCluster()
		if err != nil {
			return err
		}
		bootstrap, asked = !existing, true
	}

	rc := cfg.Raft
	rc.ID, rc.Dir = cfg.ID, cfg.DataDir
	rc.RaftBind, rc.RaftListener, rc.RaftAdvertise = cfg.RaftListen, cfg.RaftListener, cfg.RaftAdvertise
	rc.Dial, rc.Logger = cfg.Dial, cfg.Logger
	if rc.ObserveApply == nil {
		rc.ObserveApply = s.raftMetrics.ObserveApply
	}
	if cfg.TLS != nil {
		// The Raft port admits servers only, and dials them under TLS.
		if rc.RaftListener == nil {
			if rc.RaftListener, err = net.Listen("tcp", cfg.RaftListen); err != nil {
				return fmt.Errorf("server: raft listen: %w", err)
			}
		}
		rc.RaftListener = cfg.TLS.Listener(rc.RaftListener, pki.RoleServer)
		rc.Dial = s.dialData
	}
	if s.store, err = raftstore.Open(rc); err != nil {
		if cfg.TLS != nil && cfg.RaftListener == nil {
			rc.RaftListener.Close() // bound above
		}
		return err
	}
	if err := s.startDataPlane(); err != nil {
		return err
	}

	opts := append(apiLimits(cfg.API),
		grpc.ChainUnaryInterceptor(s.apiMetrics.Unary, s.logCalls, s.authorize, s.checkCluster, s.fwd.intercept),
		grpc.ChainStreamInterceptor(s.apiMetrics.Stream, s.authorizeStream),
	)
	if cfg.TLS != nil {
		opts = append(opts, cfg.TLS.GRPCServerCredentials())
	}
	s.grpc = grpc.NewServer(opts...)
	storpb.RegisterClusterServiceServer(s.grpc, &clusterService{s: s})
	storpb.RegisterVolumeServiceServer(s.grpc, &volumeService{s: s})
	storpb.RegisterSnapshotServiceServer(s.grpc, &snapshotService{s: s})
	healthpb.RegisterHealthServer(s.grpc, &healthService{s: s})
	s.registerMetrics()
	if err := s.serveMetrics(); err != nil {
		return err
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := s.grpc.Serve(netutil.LimitListener(s.lis, cfg.API.MaxConns)); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			s.logger.Error("control API stopped", "err", err)
		}
	}()

	switch {
	case s.store.HadState() && s.store.Member():
		s.logger.Info("resuming with existing state", "data_dir", cfg.DataDir)
	case s.store.HadState():
		// Raft state, but no join recorded: joining again is harmless,
		// and a server refused for a replaced data dir keeps asking.
		s.logger.Info("resuming with Raft state but no recorded join: joining again", "data_dir", cfg.DataDir)
		s.startJoining()
	case bootstrap:
		if len(cfg.Join) > 0 && !asked {
			// A used data dir without Raft state: a start that stopped
			// between writing its identity and bootstrapping.
			existing, err := s.existingCluster()
			if err != nil {
				return err
			}
			if existing {
				s.startJoining()
				break
			}
		}
		if err := s.store.Bootstrap(); err != nil {
			return err
		}
	default:
		s.startJoining()
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.heartbeatLoop()
	}()
	s.logger.Info("stor-server started", "listen", s.lis.Addr().String(), "raft", s.store.RaftAddress(),
		"advertise", cfg.Advertise, "data_dir", cfg.DataDir, "capacity", cfg.Capacity)
	return nil
}

// privateDir makes the data dir, or makes an existing one (a
// PersistentVolume's root, a hostPath), readable by its owner only: it
// holds every replica's data, the Raft log and, under make cluster, the
// TLS keys.
func privateDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("server: data dir: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return fmt.Errorf("server: data dir: %w", err)
	}
	return nil
}

func filesystemSize(dir string) (uint64, error) {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return 0, fmt.Errorf("server: measure capacity of %s: %w (set --capacity)", dir, err)
	}
	return st.Blocks * uint64(st.Bsize), nil
}

// Addr is the control API's listen address.
func (s *Server) Addr() string { return s.lis.Addr().String() }

// Store exposes the metadata store to in-process tests and harnesses.
func (s *Server) Store() *raftstore.Store { return s.store }

// self describes this server as it registers and reports.
func (s *Server) self() *storpb.Server {
	srv := &storpb.Server{
		Id: s.cfg.ID, Address: s.cfg.Advertise, RaftAddress: s.store.RaftAddress(),
		DataAddress: s.cfg.DataAdvertise, Zone: s.cfg.Zone, Labels: s.cfg.Labels,
		CapacityBytes: s.cfg.Capacity, KubernetesNode: s.cfg.KubernetesNode,
		UsedBytes: filesystemUsed(s.cfg.DataDir), DataDirId: s.store.DataDirID(),
		RaftClusterCheck: true,
	}
	if jepsenIgnoreDataDir {
		srv.DataDirId = ""
	}
	return srv
}

// filesystemUsed is what the filesystem of dir has in use (0 if unknown).
func filesystemUsed(dir string) uint64 {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return 0
	}
	return (st.Blocks - st.Bfree) * uint64(st.Bsize)
}

// ErrSecondCluster is returned by Start when this server, with no state,
// would bootstrap a new cluster although its seeds' cluster still has it as
// a member.
var ErrSecondCluster = errors.New("server: would bootstrap a second cluster")

// existingCluster guards the one case where bootstrapping with seeds is
// dangerous: ordinal 0 of a StatefulSet that has no state because its data
// disk was lost or replaced while the cluster lived on. Bootstrapping there
// would make a second one-member cluster under the same name, and clients
// would see two histories. So before it bootstraps, a server with seeds asks
// each other seed for its status. A seed that answers with a cluster id
// means the cluster exists: if this server is still one of its members (its
// state is gone, the cluster's record of it is not), the start is refused,
// naming the way out (remove the server from the cluster); if it is not a
// member, it joins like any other ordinal (true, nil). Seeds that do not
// answer within a few seconds cannot vouch for a cluster: at a first
// install they are starting too, and ordinal 0 bootstraps (false, nil).
func (s *Server) existingCluster() (bool, error) {
	for _, seed := range s.cfg.Join {
		if seed == s.cfg.Advertise || seed == s.lis.Addr().String() {
			continue
		}
		st, err := callPeerTimeout(s, seed, 3*time.Second, func(ctx context.Context, c storpb.ClusterServiceClient) (*storpb.StatusResponse, error) {
			return c.Status(ctx, &storpb.StatusRequest{})
		})
		if err != nil || st.ClusterId == "" || st.ServerId == s.cfg.ID {
			continue
		}
		for _, m := range st.Members {
			if m.Id == s.cfg.ID {
				return true, fmt.Errorf("%w: %s has no state in %s, but seed %s (server %s) has it as a member of cluster %s; "+
					"if this server's data was lost, remove it from the cluster (stor-ctl server remove %s) and start it again to join afresh",
					ErrSecondCluster, s.cfg.ID, s.cfg.DataDir, seed, st.ServerId, st.ClusterId, s.cfg.ID)
			}
		}
		s.logger.Info("a cluster exists already: joining it instead of bootstrapping", "seed", seed, "cluster", st.ClusterId)
		return true, nil
	}
	return false, nil
}

// startJoining runs joinLoop in the background, unless it runs.
func (s *Server) startJoining() {
	if !s.joining.CompareAndSwap(false, true) {
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		defer s.joining.Store(false)
		s.joinLoop()
	}()
}

// joinLoop asks the seeds, in turn, to admit this server until one does.
func (s *Server) joinLoop() {
	backoff := 100 * time.Millisecond
	for attempt := 0; ; attempt++ {
		for _, seed := range s.cfg.Join {
			if seed == s.cfg.Advertise {
				continue
			}
			resp, err := s.joinVia(seed)
			if err == nil {
				if err = s.store.Joined(resp.ClusterId); err == nil {
					s.logger.Info("joined cluster", "cluster", resp.ClusterId, "via", seed, "voter", resp.Voter)
					return
				}
				// Not recorded: not a member (not ready, votes for
				// no one) until it is; joining again is harmless.
				s.logger.Error("record membership; joining again", "err", err)
				continue
			}
			refused := dataDirRefused(err)
			if refused {
				s.dirRefused.Store(true)
			}
			switch {
			case attempt%10 != 0:
			case refused, errors.Is(err, errOtherCluster):
				// Refused (a data dir the cluster does not know this
				// server on, or one of another cluster): the error says
				// what to do.
				s.logger.Error("the cluster refuses this server's join; retrying", "seed", seed, "err", err)
			default:
				s.logger.Warn("join failed; retrying", "seed", seed, "err", err)
			}
		}
		select {
		case <-s.ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(backoff*2, 2*time.Second)
	}
}

// joinVia asks seed's cluster to admit this server. It first learns
// which cluster that is, from the seed: the Raft transport of a server
// of no cluster hears only servers of the one it joins, the leader's
// among them while the join is in progress (raftstore's cluster check);
// a server of another cluster (its data dir's) does not ask.
func (s *Server) joinVia(seed string) (*storpb.JoinResponse, error) {
	st, err := callPeer(s, seed, func(ctx context.Context, c storpb.ClusterServiceClient) (*storpb.StatusResponse, error) {
		return c.Status(ctx, &storpb.StatusRequest{})
	})
	if err != nil {
		return nil, err
	}
	switch ours := s.store.MemberOf(); {
	case st.ClusterId == "":
		return nil, fmt.Errorf("seed %s is of no cluster yet", seed)
	case ours != "" && ours != st.ClusterId:
		return nil, fmt.Errorf("%w: this server's data dir is of cluster %s, seed %s is of cluster %s: start it on an empty data dir to join that cluster",
			errOtherCluster, ours, seed, st.ClusterId)
	}
	s.store.JoiningCluster(st.ClusterId) // the seed's, asked each time
	resp, err := callPeer(s, seed, func(ctx context.Context, c storpb.ClusterServiceClient) (*storpb.JoinResponse, error) {
		return c.Join(ctx, &storpb.JoinRequest{Server: s.self()})
	})
	if err == nil && resp.ClusterId != st.ClusterId {
		// Admitted by another cluster than the seed's (it changed in
		// between?): not recorded, not a member; asked again.
		return nil, fmt.Errorf("seed %s is of cluster %s, and admitted this server to cluster %s", seed, st.ClusterId, resp.ClusterId)
	}
	return resp, err
}

// errOtherCluster: a server's data dir is of another cluster than its
// seeds'.
var errOtherCluster = errors.New("server: a data dir of another cluster")

// heartbeatLoop reports to the leader every HeartbeatInterval.
func (s *Server) heartbeatLoop() {
	t := time.NewTicker(s.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		if err := s.heartbeat(); err != nil && status.Code(err) != codes.NotFound {
			s.logger.Debug("heartbeat", "err", err)
		}
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (s *Server) heartbeat() error {
	err := s.report()
	switch {
	case err == nil:
		s.dirRefused.Store(false)
	case dataDirRefused(err):
		s.dirRefused.Store(true)
		if time.Since(s.dirRefusedSaid) >= 30*time.Second {
			s.dirRefusedSaid = time.Now()
			s.logger.Error("the cluster refuses this server's reports: it is not ready, and makes no replica", "err", err)
		}
	case otherClusterRefused(err):
		if time.Since(s.otherClusterSaid) >= 30*time.Second {
			s.otherClusterSaid = time.Now()
			s.logger.Warn("this server's heartbeats reach a server of another cluster (at the address it knows for its leader, reused?): refused; it goes on until it learns its leader's address", "err", err)
		}
	case s.dirRefused.Load() && (errors.Is(err, raftstore.ErrNotFound) || status.Code(err) == codes.NotFound):
		// Refused for its data dir, then removed (the way out the
		// refusal names): it joins afresh, on this data dir.
		s.logger.Info("removed from the cluster after its data dir was refused: joining afresh")
		s.startJoining()
	case s.store.Member() && !s.joining.Load() && (errors.Is(err, raftstore.ErrNotFound) || status.Code(err) == codes.NotFound):
		// A member the cluster has no record of: removed (stor-ctl
		// server remove) while it ran or was down. It stays out.
		if !s.removed.Swap(true) {
			s.logger.Error("the cluster has no record of this server: it was removed; it stays out (not ready, no replica made) until started on an empty data dir, where it joins afresh")
		}
	}
	if err == nil {
		s.removed.Store(false)
	}
	return err
}

// dataDirRefused reports whether err is the leader's refusal of this
// server's data dir (raftstore.ErrDataDirReplaced), here or over gRPC.
func dataDirRefused(err error) bool {
	return errors.Is(err, raftstore.ErrDataDirReplaced) ||
		(status.Code(err) == codes.FailedPrecondition && strings.Contains(status.Convert(err).Message(), dataDirReplacedMsg))
}

// dataDirReplacedMsg is what the status message of a refusal for a data
// dir holds (toStatus drops the "raftstore: " prefixes).
var dataDirReplacedMsg = strings.ReplaceAll(raftstore.ErrDataDirReplaced.Error(), "raftstore: ", "")

// report sends one heartbeat to the leader (registering this server if it
// leads and has no record of itself yet).
func (s *Server) report() error {
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.HeartbeatInterval)
	defer cancel()
	if s.store.IsLeader() {
		err := s.store.Heartbeat(ctx, s.self())
		if errors.Is(err, raftstore.ErrNotFound) {
			// The bootstrapping server registers itself once it leads.
			_, _, err = s.store.Join(ctx, s.self())
		}
		return err
	}
	// The leader as this server knows it; if unknown (partitioned, or its
	// raft address changed so the leader cannot reach it), the seeds.
	targets := s.cfg.Join
	if _, addr, err := s.store.LeaderAddress(); err == nil {
		targets = []string{addr}
	}
	var err error
	for _, addr := range targets {
		_, err = callPeer(s, addr, func(ctx context.Context, c storpb.ClusterServiceClient) (*storpb.HeartbeatResponse, error) {
			return c.Heartbeat(ctx, &storpb.HeartbeatRequest{Server: s.self()})
		})
		if err == nil {
			return nil
		}
	}
	return err
}

// callPeer calls another server's ClusterService with a short timeout,
// reusing the forwarder's connection cache.
func callPeer[T any](s *Server, addr string, call func(context.Context, storpb.ClusterServiceClient) (T, error)) (T, error) {
	return callPeerTimeout(s, addr, 5*time.Second, call)
}

// callPeerTimeout is callPeer with a timeout of its own.
func callPeerTimeout[T any](s *Server, addr string, timeout time.Duration, call func(context.Context, storpb.ClusterServiceClient) (T, error)) (T, error) {
	var zero T
	conn, err := s.fwd.conn(addr)
	if err != nil {
		return zero, err
	}
	ctx, cancel := context.WithTimeout(s.ctx, timeout)
	defer cancel()
	return call(ctx, storpb.NewClusterServiceClient(conn))
}

func (s *Server) logCalls(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	start := time.Now()
	resp, err := handler(ctx, req)
	if info.FullMethod == storpb.ClusterService_Heartbeat_FullMethodName {
		return resp, err
	}
	code := status.Code(err)
	lvl := slog.LevelDebug
	if code == codes.Internal || code == codes.DataLoss {
		lvl = slog.LevelError
	}
	s.logger.Log(ctx, lvl, "rpc", "method", info.FullMethod, "code", code.String(), "duration", time.Since(start), "err", err)
	return resp, err
}

// Close shuts down gracefully: hands off leadership, drains RPCs (bounded by
// ShutdownTimeout), stops Raft and closes the data dir.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.ShutdownTimeout)
		defer cancel()
		if err := s.store.TransferLeadership(ctx); err != nil {
			s.logger.Warn("leadership transfer before shutdown failed", "err", err)
		}
		s.cancel()
		stopped := make(chan struct{})
		go func() {
			s.grpc.GracefulStop()
			close(stopped)
		}()
		select {
		case <-stopped:
		case <-ctx.Done():
			s.grpc.Stop()
			<-stopped
		}
		s.closeErr = s.shutdown()
		s.logger.Info("stor-server stopped")
	})
	return s.closeErr
}

// Kill stops the server abruptly, the closest an in-process test gets to
// kill -9: no leadership transfer, in-flight RPCs are cut off.
func (s *Server) Kill() {
	s.closeOnce.Do(func() {
		s.cancel()
		s.grpc.Stop()
		s.closeErr = s.shutdown()
	})
}

func (s *Server) shutdown() error {
	var errs []error
	if s.metricsSrv != nil {
		errs = append(errs, s.metricsSrv.Close())
	}
	if s.data != nil {
		errs = append(errs, s.data.close())
	}
	errs = append(errs, s.store.Close())
	s.wg.Wait()
	s.fwd.close()
	return errors.Join(errs...)
}

// selfConn is a client connection to this server's own control API (calls
// are forwarded to the leader like any other).
func (s *Server) selfConn() *grpc.ClientConn {
	c, err := s.fwd.conn(s.cfg.Advertise)
	if err != nil {
		panic(fmt.Sprintf("server: dial own address %s: %v", s.cfg.Advertise, err)) // NewClient fails only on a malformed target
	}
	return c
}

// Run starts a server and runs it until ctx is cancelled, then closes it
// gracefully.
func Run(ctx context.Context, cfg Config) error {
	s, err := Start(cfg)
	if err != nil {
		return err
	}
	<-ctx.Done()
	return s.Close()
}
