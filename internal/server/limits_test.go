package server_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	storpb "github.com/stor-io/stor/api/proto"
	"github.com/stor-io/stor/internal/server"
	"github.com/stor-io/stor/internal/servertest"
)

// h2Conn opens a raw HTTP/2 connection to a control API and returns the
// server's SETTINGS, or ok false if none came within wait (the server has
// not accepted the connection).
func h2Conn(t *testing.T, addr string, wait time.Duration) (nc net.Conn, settings map[http2.SettingID]uint32, ok bool) {
	t.Helper()
	nc, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { nc.Close() })
	if _, err := nc.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(nc, nc)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	nc.SetReadDeadline(time.Now().Add(wait))
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			return nc, nil, false
		}
		if sf, isSettings := f.(*http2.SettingsFrame); isSettings && !sf.IsAck() {
			settings = map[http2.SettingID]uint32{}
			sf.ForeachSetting(func(s http2.Setting) error { settings[s.ID] = s.Val; return nil })
			nc.SetReadDeadline(time.Time{})
			return nc, settings, true
		}
	}
}

// TestControlAPILimits: the control API advertises its per-connection
// call limit, refuses an oversized request with ResourceExhausted, and
// serves at most MaxConns connections (the next one waits, and is served
// once one closes).
func TestControlAPILimits(t *testing.T) {
	const maxConns = 4
	c := servertest.NewCluster(t, servertest.Options{Servers: 1, Configure: func(_ int, cfg *server.Config) {
		cfg.API = server.APILimits{MaxConns: maxConns, MaxConcurrentStreams: 7, MaxRecvMsgSize: 64 << 10}
	}})
	c.Leader(10 * time.Second)
	addr := c.Nodes[0].Addr

	first, settings, ok := h2Conn(t, addr, 5*time.Second)
	if !ok {
		t.Fatal("no SETTINGS from the control API")
	}
	if got := settings[http2.SettingMaxConcurrentStreams]; got != 7 {
		t.Errorf("SETTINGS_MAX_CONCURRENT_STREAMS %d, want 7", got)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := c.Client(0).Volumes.GetVolume(ctx, &storpb.GetVolumeRequest{Volume: &storpb.VolumeRef{Id: strings.Repeat("x", 100<<10)}})
	if status.Code(err) != codes.ResourceExhausted {
		t.Errorf("a 100 KiB request with MaxRecvMsgSize 64 KiB: code %v, want ResourceExhausted", status.Code(err))
	}

	// The test client and the h2Conn above hold connections (and the server
	// may hold one to itself): open more until one is not accepted.
	held := []net.Conn{first}
	var waiting net.Conn
	for range maxConns + 1 {
		nc, _, ok := h2Conn(t, addr, time.Second)
		if !ok {
			waiting = nc
			break
		}
		held = append(held, nc)
	}
	if waiting == nil {
		t.Fatalf("%d more connections accepted with MaxConns %d", len(held)-1, maxConns)
	}
	held[0].Close()
	waiting.SetReadDeadline(time.Now().Add(5 * time.Second))
	fr := http2.NewFramer(waiting, waiting)
	if _, err := fr.ReadFrame(); err != nil {
		t.Fatalf("the waiting connection was not served once another closed: %v", err)
	}
}
