package server

import (
	"log/slog"
	"net"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"

	"github.com/stor-io/stor/raftstore"
	"github.com/stor-io/stor/replica/wire"
)

// apiLimits turns APILimits into gRPC server options. The connection cap
// is the listener's (netutil.LimitListener in Start).
func apiLimits(l APILimits) []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.MaxConcurrentStreams(l.MaxConcurrentStreams),
		grpc.MaxRecvMsgSize(l.MaxRecvMsgSize),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{
			MinTime:             l.KeepaliveMinTime,
			PermitWithoutStream: true,
		}),
		grpc.KeepaliveParams(keepalive.ServerParameters{
			MaxConnectionIdle: l.MaxConnectionIdle,
		}),
		grpc.ConnectionTimeout(l.ConnectionTimeout),
	}
}

// page is the raftstore.Page a listing request gets: its size, 0 taking
// the default and cut to the maximum, and the byte bound.
func (l APILimits) page(size uint32, token string) raftstore.Page {
	n := int(min(size, uint32(l.MaxPageSize)))
	if n == 0 {
		n = l.DefaultPageSize
	}
	return raftstore.Page{Token: token, Limit: min(n, l.MaxPageSize), MaxBytes: l.MaxPageBytes}
}

// dataConfig is the replica data service's configuration: cfg (its
// limits) with the server's logger, the authoriser of every OPEN and
// request (dataauth.go) and how a peer is identified.
func dataConfig(cfg wire.ServerConfig, logger *slog.Logger, auth wire.Authorizer, identify func(net.Conn) wire.Identity) wire.ServerConfig {
	cfg.Logger, cfg.Authorizer, cfg.Identify = logger, auth, identify
	return cfg
}
