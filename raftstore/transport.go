package raftstore

import (
	"context"
	"io"
	"log/slog"
	"net"
	"strings"
	"time"

	"github.com/hashicorp/go-hclog"
	"github.com/hashicorp/raft"
)

// streamLayer is raft.StreamLayer over a listener, dialing through the
// Config.Dial seam so tests can cut links.
type streamLayer struct {
	net.Listener
	advertise net.Addr
	dial      func(ctx context.Context, network, addr string) (net.Conn, error)
}

func (s *streamLayer) Addr() net.Addr { return s.advertise }

func (s *streamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return s.dial(ctx, "tcp", string(address))
}

// hclogFor routes hashicorp/raft's hclog output into slog. raft logs
// preformatted lines; each becomes one slog record with component=raft.
func hclogFor(l *slog.Logger) hclog.Logger {
	return hclog.New(&hclog.LoggerOptions{
		Name:        "raft",
		Level:       hclog.Info,
		Output:      slogWriter{l.With("component", "raft")},
		DisableTime: true,
	})
}

type slogWriter struct{ l *slog.Logger }

func (w slogWriter) Write(p []byte) (int, error) {
	line := strings.TrimSpace(string(p))
	switch {
	case strings.HasPrefix(line, "[ERROR]"):
		w.l.Error(strings.TrimSpace(line[7:]))
	case strings.HasPrefix(line, "[WARN]"):
		w.l.Warn(strings.TrimSpace(line[6:]))
	case strings.HasPrefix(line, "[INFO]"):
		w.l.Info(strings.TrimSpace(line[6:]))
	default:
		w.l.Debug(line)
	}
	return len(p), nil
}

var _ io.Writer = slogWriter{}
