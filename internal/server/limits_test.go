package server_test

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
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

// TestListingsPage: with a client that accepts at most 16 KiB per message
// and more volumes, snapshots and nodes than fit in one, every listing
// asked for "everything" (page size 0, or a huge one) answers a page that
// fits, and following the tokens yields each entry exactly once. Unpaged,
// the one response exceeded the client's limit (ResourceExhausted).
func TestListingsPage(t *testing.T) {
	const n, recvLimit = 40, 16 << 10
	c := servertest.NewCluster(t, servertest.Options{Servers: 1, Configure: func(_ int, cfg *server.Config) {
		cfg.API.MaxPageBytes = 8 << 10
	}})
	c.Leader(10 * time.Second)
	cl := c.Client(0)
	pad := strings.Repeat("p", 400)
	for i := range n {
		name := fmt.Sprintf("vol-%02d", i)
		retry(t, 10*time.Second, func(ctx context.Context) (*storpb.CreateVolumeResponse, error) {
			return cl.Volumes.CreateVolume(ctx, &storpb.CreateVolumeRequest{Name: name, SizeBytes: 1 << 20, ReplicaCount: 1, Parameters: map[string]string{"pad": pad}})
		})
		retry(t, 10*time.Second, func(ctx context.Context) (*storpb.RegisterNodeResponse, error) {
			return cl.Cluster.RegisterNode(ctx, &storpb.RegisterNodeRequest{Node: &storpb.Node{Id: fmt.Sprintf("node-%02d", i), Labels: map[string]string{"pad": pad}}})
		})
	}

	conn, err := grpc.NewClient("passthrough:///"+c.Nodes[0].Addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(recvLimit)))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	vols, clu := storpb.NewVolumeServiceClient(conn), storpb.NewClusterServiceClient(conn)

	for _, size := range []uint32{0, 1 << 20} {
		seen := map[string]bool{}
		pages := 0
		for token := ""; pages == 0 || token != ""; pages++ {
			if pages > 2*n {
				t.Fatalf("page size %d: no last page after %d pages", size, pages)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			resp, err := vols.ListVolumes(ctx, &storpb.ListVolumesRequest{PageSize: size, PageToken: token})
			cancel()
			if err != nil {
				t.Fatalf("ListVolumes page %d (page size %d): %v", pages, size, status.Code(err))
			}
			for _, v := range resp.Volumes {
				if seen[v.Name] {
					t.Fatalf("volume %s listed twice", v.Name)
				}
				seen[v.Name] = true
			}
			token = resp.NextPageToken
		}
		if len(seen) != n || pages < 2 {
			t.Errorf("page size %d: %d volumes in %d pages, want %d in several", size, len(seen), pages, n)
		}

		seen = map[string]bool{}
		pages = 0
		for token := ""; pages == 0 || token != ""; pages++ {
			if pages > 2*n {
				t.Fatalf("nodes: no last page after %d pages", pages)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			resp, err := clu.ListNodes(ctx, &storpb.ListNodesRequest{PageSize: size, PageToken: token})
			cancel()
			if err != nil {
				t.Fatalf("ListNodes page %d (page size %d): %v", pages, size, status.Code(err))
			}
			for _, nd := range resp.Nodes {
				if seen[nd.Id] {
					t.Fatalf("node %s listed twice", nd.Id)
				}
				seen[nd.Id] = true
			}
			token = resp.NextPageToken
		}
		if len(seen) != n || pages < 2 {
			t.Errorf("nodes, page size %d: %d in %d pages, want %d in several", size, len(seen), pages, n)
		}
	}

	// The default page size applies with no byte bound in the way.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := c.Client(0).Cluster.ListNodes(ctx, &storpb.ListNodesRequest{PageSize: 7})
	if err != nil || len(resp.Nodes) > 7 || resp.NextPageToken == "" {
		t.Fatalf("ListNodes with page size 7: %d nodes, next %q, err %v", len(resp.GetNodes()), resp.GetNextPageToken(), err)
	}
}
