package raftstore

import (
	"errors"
	"flag"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

var placeSeedFlag = flag.Uint64("placement.seed", 0, "seed for TestPlaceRandomized; 0 takes one from the clock")

type placeOpt func(*storpb.Server)

// placeSrv returns an up server with unreported (unlimited) capacity.
func placeSrv(id, zone string, opts ...placeOpt) *storpb.Server {
	s := &storpb.Server{Id: id, Zone: zone, State: storpb.ServerState_SERVER_STATE_UP}
	for _, o := range opts {
		o(s)
	}
	return s
}

func placeState(st storpb.ServerState) placeOpt { return func(s *storpb.Server) { s.State = st } }

func placeCap(capacity, allocated uint64) placeOpt {
	return func(s *storpb.Server) { s.CapacityBytes, s.AllocatedBytes = capacity, allocated }
}

func placeK8sNode(n string) placeOpt { return func(s *storpb.Server) { s.KubernetesNode = n } }

func placeLabel(k, v string) placeOpt {
	return func(s *storpb.Server) {
		if s.Labels == nil {
			s.Labels = map[string]string{}
		}
		s.Labels[k] = v
	}
}

// placeTopo builds a topology from key, value pairs.
func placeTopo(kv ...string) *storpb.Topology {
	t := &storpb.Topology{Segments: map[string]string{}}
	for i := 0; i+1 < len(kv); i += 2 {
		t.Segments[kv[i]] = kv[i+1]
	}
	return t
}

func placeAccess(requisite, preferred []*storpb.Topology) *storpb.TopologyRequirement {
	return &storpb.TopologyRequirement{Requisite: requisite, Preferred: preferred}
}

// place3x2 is three zones of two servers each, all with unlimited capacity.
func place3x2(opts map[string][]placeOpt) []*storpb.Server {
	var ss []*storpb.Server
	for _, z := range []string{"a", "b", "c"} {
		for _, n := range []string{"1", "2"} {
			ss = append(ss, placeSrv(z+n, z, opts[z+n]...))
		}
	}
	return ss
}

func TestTopologyMatches(t *testing.T) {
	srv := placeSrv("s1", "a", placeLabel("rack", "r1"), placeLabel("zone", "b"), placeLabel("empty", ""), placeK8sNode("worker-1"))
	noZone := placeSrv("s2", "")
	tests := []struct {
		name string
		t    *storpb.Topology
		s    *storpb.Server
		want bool
	}{
		{"node matches id", placeTopo("node", "s1"), srv, true},
		{"node mismatch", placeTopo("node", "s2"), srv, false},
		{"node matches the Kubernetes node", placeTopo("node", "worker-1"), srv, true},
		{"node mismatches another Kubernetes node", placeTopo("node", "worker-2"), srv, false},
		{"empty node never matches an unset Kubernetes node", placeTopo("node", ""), noZone, false},
		{"Kubernetes node and zone", placeTopo("node", "worker-1", "zone", "a"), srv, true},
		{"zone matches", placeTopo("zone", "a"), srv, true},
		{"zone label does not override zone field", placeTopo("zone", "b"), srv, false},
		{"empty zone matches empty zone", placeTopo("zone", ""), noZone, true},
		{"empty zone does not match zone a", placeTopo("zone", ""), srv, false},
		{"label matches", placeTopo("rack", "r1"), srv, true},
		{"label mismatch", placeTopo("rack", "r2"), srv, false},
		{"label present with empty value", placeTopo("empty", ""), srv, true},
		{"missing label never matches", placeTopo("row", ""), srv, false},
		{"all segments match", placeTopo("zone", "a", "rack", "r1", "node", "s1"), srv, true},
		{"one segment of several mismatches", placeTopo("zone", "a", "rack", "r2"), srv, false},
		{"empty topology matches all", placeTopo(), srv, true},
		{"nil topology matches all", nil, srv, true},
		{"nil server matches nothing", placeTopo(), nil, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := TopologyMatches(tt.t, tt.s); got != tt.want {
				t.Errorf("TopologyMatches(%v, %v) = %v, want %v", tt.t, tt.s, got, tt.want)
			}
		})
	}
}

func TestPlace(t *testing.T) {
	down := storpb.ServerState_SERVER_STATE_DOWN
	draining := storpb.ServerState_SERVER_STATE_DRAINING
	unspecified := storpb.ServerState_SERVER_STATE_UNSPECIFIED

	tests := []struct {
		name    string
		servers []*storpb.Server
		req     PlaceRequest
		want    []string
		wantErr error
		wantMsg []string // substrings of the error message
	}{
		// Validation.
		{
			name:    "zero replicas",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: 0},
			wantErr: ErrInvalidArgument,
		},
		{
			name:    "negative replicas",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: -1},
			wantErr: ErrInvalidArgument,
		},
		{
			name:    "nil server",
			servers: []*storpb.Server{placeSrv("s1", "a"), nil},
			req:     PlaceRequest{Replicas: 1},
			wantErr: ErrInvalidArgument,
		},
		{
			name:    "server without id",
			servers: []*storpb.Server{placeSrv("s1", "a"), placeSrv("", "a")},
			req:     PlaceRequest{Replicas: 1},
			wantErr: ErrInvalidArgument,
		},
		{
			name:    "server listed twice",
			servers: []*storpb.Server{placeSrv("s2", "a"), placeSrv("s1", "a"), placeSrv("s2", "b"), placeSrv("s1", "b")},
			req:     PlaceRequest{Replicas: 1},
			wantErr: ErrInvalidArgument,
			wantMsg: []string{`"s1" listed twice`},
		},

		// Distinct servers.
		{
			name:    "one replica, one server",
			servers: []*storpb.Server{placeSrv("s1", "a")},
			req:     PlaceRequest{Replicas: 1},
			want:    []string{"s1"},
		},
		{
			name:    "distinct servers in one zone",
			servers: []*storpb.Server{placeSrv("s3", "a"), placeSrv("s1", "a"), placeSrv("s2", "a")},
			req:     PlaceRequest{Replicas: 3},
			want:    []string{"s1", "s2", "s3"},
		},
		{
			name:    "never two replicas on one server",
			servers: []*storpb.Server{placeSrv("s1", "a"), placeSrv("s2", "a")},
			req:     PlaceRequest{Replicas: 3},
			wantErr: ErrInsufficientServers,
			wantMsg: []string{"need 3 servers", "2 eligible of 2"},
		},
		{
			name:    "no servers",
			req:     PlaceRequest{Replicas: 1},
			wantErr: ErrInsufficientServers,
			wantMsg: []string{"need 1 servers", "0 eligible of 0"},
		},

		// Zone spreading.
		{
			name: "3 zones x 2 servers, 3 replicas: one per zone, most free first",
			servers: place3x2(map[string][]placeOpt{
				"a1": {placeCap(100, 90)}, "a2": {placeCap(100, 80)},
				"b1": {placeCap(100, 70)}, "b2": {placeCap(100, 95)},
				"c1": {placeCap(100, 99)}, "c2": {placeCap(100, 98)},
			}),
			req:  PlaceRequest{Replicas: 3, SizeBytes: 1},
			want: []string{"b1", "a2", "c2"},
		},
		{
			name:    "3 zones x 2 servers, 6 replicas: round robin",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: 6},
			want:    []string{"a1", "b1", "c1", "a2", "b2", "c2"},
		},
		{
			name:    "2 zones, 3 replicas: 2+1",
			servers: []*storpb.Server{placeSrv("b2", "b"), placeSrv("a2", "a"), placeSrv("b1", "b"), placeSrv("a1", "a")},
			req:     PlaceRequest{Replicas: 3},
			want:    []string{"a1", "b1", "a2"},
		},
		{
			name:    "small zone used once, rest in big zone",
			servers: []*storpb.Server{placeSrv("a1", "a"), placeSrv("a2", "a"), placeSrv("a3", "a"), placeSrv("b9", "b")},
			req:     PlaceRequest{Replicas: 3},
			want:    []string{"a1", "b9", "a2"},
		},
		{
			name:    "zone spreading beats free capacity",
			servers: []*storpb.Server{placeSrv("a1", "a"), placeSrv("a2", "a"), placeSrv("b1", "b", placeCap(10, 9))},
			req:     PlaceRequest{Replicas: 2, SizeBytes: 1},
			want:    []string{"a1", "b1"},
		},
		{
			name:    "servers without zone share zone empty",
			servers: []*storpb.Server{placeSrv("x1", ""), placeSrv("x2", ""), placeSrv("a1", "a")},
			req:     PlaceRequest{Replicas: 2},
			want:    []string{"a1", "x1"},
		},

		// Server state.
		{
			name: "down, draining and unspecified excluded",
			servers: []*storpb.Server{
				placeSrv("s1", "a", placeState(down)), placeSrv("s2", "b", placeState(draining)),
				placeSrv("s3", "c", placeState(unspecified)), placeSrv("s4", "a"), placeSrv("s5", "a"),
			},
			req:  PlaceRequest{Replicas: 2},
			want: []string{"s4", "s5"},
		},
		{
			name: "down, draining and unspecified excluded: too few",
			servers: []*storpb.Server{
				placeSrv("s1", "a", placeState(down)), placeSrv("s2", "b", placeState(draining)),
				placeSrv("s3", "c", placeState(unspecified)), placeSrv("s4", "a"), placeSrv("s5", "a"),
			},
			req:     PlaceRequest{Replicas: 3},
			wantErr: ErrInsufficientServers,
			wantMsg: []string{"need 3 servers", "2 eligible of 5", "3 not up", "0 outside", "0 already"},
		},

		// Capacity.
		{
			name:    "unreported capacity is unlimited and ranks first",
			servers: []*storpb.Server{placeSrv("s1", "a", placeCap(1<<40, 0)), placeSrv("s2", "a", placeCap(0, 1<<50))},
			req:     PlaceRequest{Replicas: 1, SizeBytes: 1 << 30},
			want:    []string{"s2"},
		},
		{
			name:    "unreported capacity takes any size",
			servers: []*storpb.Server{placeSrv("s1", "a", placeCap(1<<40, 0)), placeSrv("s2", "a")},
			req:     PlaceRequest{Replicas: 1, SizeBytes: 1 << 50},
			want:    []string{"s2"},
		},
		{
			name:    "exact fit",
			servers: []*storpb.Server{placeSrv("s1", "a", placeCap(100, 40))},
			req:     PlaceRequest{Replicas: 1, SizeBytes: 60},
			want:    []string{"s1"},
		},
		{
			name:    "one byte short",
			servers: []*storpb.Server{placeSrv("s1", "a", placeCap(100, 41))},
			req:     PlaceRequest{Replicas: 1, SizeBytes: 60},
			wantErr: ErrInsufficientCapacity,
			wantMsg: []string{"need 1 servers with 60 bytes free", "0 of 1", "at most 59 bytes"},
		},
		{
			name:    "over-allocated server has no free capacity",
			servers: []*storpb.Server{placeSrv("s1", "a", placeCap(100, 200))},
			req:     PlaceRequest{Replicas: 1, SizeBytes: 1},
			wantErr: ErrInsufficientCapacity,
		},
		{
			name: "enough servers, too few with room",
			servers: []*storpb.Server{
				placeSrv("s1", "a", placeCap(100, 0)), placeSrv("s2", "b", placeCap(100, 50)), placeSrv("s3", "c", placeCap(200, 100)),
			},
			req:     PlaceRequest{Replicas: 3, SizeBytes: 60},
			wantErr: ErrInsufficientCapacity,
			wantMsg: []string{"need 3 servers with 60 bytes free", "2 of 3", "at most 50 bytes"},
		},
		{
			name: "too small server skipped",
			servers: []*storpb.Server{
				placeSrv("s1", "a", placeCap(100, 0)), placeSrv("s2", "b", placeCap(100, 50)), placeSrv("s3", "c", placeCap(200, 100)),
			},
			req:  PlaceRequest{Replicas: 2, SizeBytes: 60},
			want: []string{"s1", "s3"},
		},
		{
			name:    "too few servers reported before too little capacity",
			servers: []*storpb.Server{placeSrv("s1", "a", placeState(down)), placeSrv("s2", "b", placeCap(10, 0))},
			req:     PlaceRequest{Replicas: 2, SizeBytes: 60},
			wantErr: ErrInsufficientServers,
			wantMsg: []string{"need 2 servers", "1 eligible of 2", "1 not up"},
		},

		// Requisite topology.
		{
			name:    "requisite zone",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: 2, Accessibility: placeAccess([]*storpb.Topology{placeTopo("zone", "b")}, nil)},
			want:    []string{"b1", "b2"},
		},
		{
			name:    "requisite two zones",
			servers: place3x2(nil),
			req: PlaceRequest{Replicas: 2, Accessibility: placeAccess(
				[]*storpb.Topology{placeTopo("zone", "c"), placeTopo("zone", "a")}, nil)},
			want: []string{"a1", "c1"},
		},
		{
			name:    "requisite zone: too few",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: 3, Accessibility: placeAccess([]*storpb.Topology{placeTopo("zone", "b")}, nil)},
			wantErr: ErrInsufficientServers,
			wantMsg: []string{"need 3 servers in zone=b", "2 eligible of 6", "4 outside the requisite topology"},
		},
		{
			name:    "requisite node",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: 1, Accessibility: placeAccess([]*storpb.Topology{placeTopo("node", "b2")}, nil)},
			want:    []string{"b2"},
		},
		{
			name:    "requisite node: two replicas",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: 2, Accessibility: placeAccess([]*storpb.Topology{placeTopo("node", "b2")}, nil)},
			wantErr: ErrInsufficientServers,
			wantMsg: []string{"in node=b2", "1 eligible of 6", "5 outside"},
		},
		{
			name: "requisite node that is down",
			servers: place3x2(map[string][]placeOpt{
				"b2": {placeState(down)},
			}),
			req:     PlaceRequest{Replicas: 1, Accessibility: placeAccess([]*storpb.Topology{placeTopo("node", "b2")}, nil)},
			wantErr: ErrInsufficientServers,
			wantMsg: []string{"0 eligible of 6", "1 not up", "5 outside"},
		},
		{
			name: "requisite label and zone",
			servers: []*storpb.Server{
				placeSrv("s1", "a", placeLabel("rack", "r2")), placeSrv("s2", "a", placeLabel("rack", "r1")),
				placeSrv("s3", "b", placeLabel("rack", "r1")),
			},
			req:  PlaceRequest{Replicas: 1, Accessibility: placeAccess([]*storpb.Topology{placeTopo("zone", "a", "rack", "r1")}, nil)},
			want: []string{"s2"},
		},
		{
			name:    "requisite label missing never matches",
			servers: []*storpb.Server{placeSrv("s1", "a"), placeSrv("s2", "b", placeLabel("rack", ""))},
			req:     PlaceRequest{Replicas: 2, Accessibility: placeAccess([]*storpb.Topology{placeTopo("rack", "")}, nil)},
			wantErr: ErrInsufficientServers,
			wantMsg: []string{"in rack=", "1 eligible of 2", "1 outside"},
		},
		{
			name:    "empty requirement is no requirement",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: 3, Accessibility: &storpb.TopologyRequirement{}},
			want:    []string{"a1", "b1", "c1"},
		},

		// Preferred topology.
		{
			name:    "preferred node gets the first replica",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: 3, Accessibility: placeAccess(nil, []*storpb.Topology{placeTopo("node", "c2")})},
			want:    []string{"c2", "a1", "b1"},
		},
		{
			name:    "preferred node beats more free capacity",
			servers: []*storpb.Server{placeSrv("s1", "a", placeCap(1000, 0)), placeSrv("s2", "a", placeCap(10, 0))},
			req:     PlaceRequest{Replicas: 2, SizeBytes: 5, Accessibility: placeAccess(nil, []*storpb.Topology{placeTopo("node", "s2")})},
			want:    []string{"s2", "s1"},
		},
		{
			name:    "preferred node beats zone spreading for the first replica",
			servers: place3x2(nil),
			req: PlaceRequest{Replicas: 2, Existing: []string{"a1"},
				Accessibility: placeAccess(nil, []*storpb.Topology{placeTopo("node", "a2")})},
			want: []string{"a2", "b1"},
		},
		{
			name: "preferred node down: next preferred topology",
			servers: place3x2(map[string][]placeOpt{
				"c1": {placeState(down)},
			}),
			req: PlaceRequest{Replicas: 2, Accessibility: placeAccess(nil,
				[]*storpb.Topology{placeTopo("node", "c1"), placeTopo("zone", "b")})},
			want: []string{"b1", "a1"},
		},
		{
			name: "preferred node too small: next preferred topology",
			servers: place3x2(map[string][]placeOpt{
				"c1": {placeCap(10, 5)},
			}),
			req: PlaceRequest{Replicas: 1, SizeBytes: 6, Accessibility: placeAccess(nil,
				[]*storpb.Topology{placeTopo("node", "c1"), placeTopo("node", "b2")})},
			want: []string{"b2"},
		},
		{
			name:    "preferred outside requisite is ignored",
			servers: place3x2(nil),
			req: PlaceRequest{Replicas: 1, Accessibility: placeAccess(
				[]*storpb.Topology{placeTopo("zone", "a")},
				[]*storpb.Topology{placeTopo("node", "b1"), placeTopo("node", "a2")})},
			want: []string{"a2"},
		},
		{
			name:    "no preferred server eligible: plain spreading",
			servers: place3x2(nil),
			req: PlaceRequest{Replicas: 2, Accessibility: placeAccess(nil,
				[]*storpb.Topology{placeTopo("node", "gone"), placeTopo("zone", "z")})},
			want: []string{"a1", "b1"},
		},
		{
			name:    "preferred order breaks zone ties",
			servers: place3x2(nil),
			req: PlaceRequest{Replicas: 3, Accessibility: placeAccess(nil,
				[]*storpb.Topology{placeTopo("zone", "b"), placeTopo("zone", "c")})},
			want: []string{"b1", "c1", "a1"},
		},
		{
			name:    "preferred zone again on later ties",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: 5, Accessibility: placeAccess(nil, []*storpb.Topology{placeTopo("zone", "c")})},
			want:    []string{"c1", "a1", "b1", "c2", "a2"},
		},
		{
			name:    "preference does not beat zone spreading after the first",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: 2, Accessibility: placeAccess(nil, []*storpb.Topology{placeTopo("zone", "a")})},
			want:    []string{"a1", "b1"},
		},
		{
			name: "preference beats free capacity on zone ties",
			servers: place3x2(map[string][]placeOpt{
				"a1": {placeCap(100, 0)}, "a2": {placeCap(100, 0)},
				"b1": {placeCap(100, 0)}, "b2": {placeCap(1000, 0)},
			}),
			req: PlaceRequest{Replicas: 2, SizeBytes: 1, Existing: []string{"c1"},
				Accessibility: placeAccess(nil, []*storpb.Topology{placeTopo("node", "gone"), placeTopo("zone", "c"), placeTopo("zone", "a")})},
			want: []string{"c2", "a1"},
		},

		// Existing replicas.
		{
			name:    "existing excluded and counted",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: 1, Existing: []string{"a1", "b1"}},
			want:    []string{"c1"},
		},
		{
			name:    "existing excluded, second replacement",
			servers: place3x2(nil),
			req:     PlaceRequest{Replicas: 2, Existing: []string{"b1", "a1"}},
			want:    []string{"c1", "a2"},
		},
		{
			name:    "existing server down still counts its zone",
			servers: []*storpb.Server{placeSrv("a1", "a", placeState(down)), placeSrv("a2", "a"), placeSrv("b1", "b")},
			req:     PlaceRequest{Replicas: 1, Existing: []string{"a1"}},
			want:    []string{"b1"},
		},
		{
			name:    "existing unknown ignored, duplicates counted once",
			servers: []*storpb.Server{placeSrv("a1", "a"), placeSrv("a2", "a"), placeSrv("b1", "b"), placeSrv("b2", "b")},
			req:     PlaceRequest{Replicas: 2, Existing: []string{"gone", "a1", "a1"}},
			want:    []string{"b1", "a2"},
		},
		{
			name:    "every server already holds a replica",
			servers: []*storpb.Server{placeSrv("a1", "a"), placeSrv("b1", "b", placeState(down))},
			req:     PlaceRequest{Replicas: 1, Existing: []string{"a1", "b1"}},
			wantErr: ErrInsufficientServers,
			wantMsg: []string{"0 eligible of 2", "0 not up", "2 already holding a replica"},
		},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := placeCheckStable(t, tt.servers, tt.req, uint64(i))
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("Place() = %v, %v; want error %v", got, err, tt.wantErr)
				}
				for _, m := range tt.wantMsg {
					if !strings.Contains(err.Error(), m) {
						t.Errorf("error %q does not mention %q", err, m)
					}
				}
				return
			}
			if err != nil || !slices.Equal(got, tt.want) {
				t.Fatalf("Place() = %v, %v; want %v", got, err, tt.want)
			}
		})
	}
}

// TestPlaceInputOrderIndependence places into a cluster full of ties (equal
// zones, equal capacities) so any dependence on input order would show.
func TestPlaceInputOrderIndependence(t *testing.T) {
	var servers []*storpb.Server
	for i := range 24 {
		servers = append(servers, placeSrv(fmt.Sprintf("s%02d", i), string(rune('a'+i%4)),
			placeCap(uint64(100+100*(i%3)), 0), placeLabel("rack", fmt.Sprint(i%2))))
	}
	slices.Reverse(servers)
	reqs := []PlaceRequest{
		{Replicas: 3, SizeBytes: 50},
		{Replicas: 7, SizeBytes: 150},
		{Replicas: 2, Existing: []string{"s00", "s05"}},
		{Replicas: 4, Accessibility: placeAccess(
			[]*storpb.Topology{placeTopo("rack", "1"), placeTopo("zone", "a")},
			[]*storpb.Topology{placeTopo("zone", "c"), placeTopo("rack", "0")})},
		{Replicas: 20, SizeBytes: 150}, // too little capacity: the message must be stable too
	}
	for i, req := range reqs {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			got, err := placeCheckStable(t, servers, req, uint64(i))
			t.Logf("Place() = %v, %v", got, err)
		})
	}
}

// placeCheckStable calls Place, checks it did not modify its inputs, and
// checks that shuffled copies of servers (fixed seed) give the same answer.
func placeCheckStable(t *testing.T, servers []*storpb.Server, req PlaceRequest, seed uint64) ([]string, error) {
	t.Helper()
	before := slices.Clone(servers)
	clones := make([]*storpb.Server, len(servers))
	for i, s := range servers {
		if s != nil {
			clones[i] = proto.Clone(s).(*storpb.Server)
		}
	}
	existing := slices.Clone(req.Existing)
	var access *storpb.TopologyRequirement
	if req.Accessibility != nil {
		access = proto.Clone(req.Accessibility).(*storpb.TopologyRequirement)
	}

	got, err := Place(servers, req)

	if !slices.Equal(servers, before) {
		t.Fatalf("Place reordered or replaced its servers argument")
	}
	for i, s := range servers {
		if s != nil && !proto.Equal(s, clones[i]) {
			t.Fatalf("Place modified server %d: %v, was %v", i, s, clones[i])
		}
	}
	if !slices.Equal(req.Existing, existing) {
		t.Fatalf("Place modified req.Existing: %v, was %v", req.Existing, existing)
	}
	if !proto.Equal(req.Accessibility, access) {
		t.Fatalf("Place modified req.Accessibility: %v, was %v", req.Accessibility, access)
	}

	rng := rand.New(rand.NewPCG(seed, 42))
	shuffled := slices.Clone(servers)
	for range 4 {
		rng.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		got2, err2 := Place(shuffled, req)
		if !slices.Equal(got, got2) || fmt.Sprint(err) != fmt.Sprint(err2) {
			t.Fatalf("input order changed the result:\n  %v, %v\n  %v, %v\nfor %s and\n    %s",
				got, err, got2, err2, placeFormatServers(servers), placeFormatServers(shuffled))
		}
	}
	return got, err
}

func TestPlaceRandomized(t *testing.T) {
	seed := *placeSeedFlag
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d; reproduce with -placement.seed=%d", seed, seed)
	rng := rand.New(rand.NewPCG(seed, 0))

	iters := 5000
	if testing.Short() {
		iters = 500
	}
	outcomes := map[string]int{}
	for i := range iters {
		servers, req := placeRandomCase(rng)
		got, err := placeCheckStable(t, servers, req, uint64(i))
		outcome, problem := placeCheckResult(servers, req, got, err)
		if problem != "" {
			t.Fatalf("case %d of seed %d: %s\nPlace() = %v, %v\nservers: %s\nrequest: %s",
				i, seed, problem, got, err, placeFormatServers(servers), placeFormatRequest(req))
		}
		outcomes[outcome]++
	}
	t.Logf("outcomes: %v", outcomes)
	// Guard the generator: a test that only ever sees errors proves little.
	// With thousands of cases a missing outcome is (astronomically) unlikely
	// unless the generator is broken.
	if iters >= 1000 {
		for _, o := range []string{"ok", "ok-preferred", "invalid", "servers", "capacity"} {
			if outcomes[o] == 0 {
				t.Errorf("no case with outcome %q in %d cases; generator too narrow", o, iters)
			}
		}
	}
}

// placeRandomCase builds a small random cluster and request. Values come from
// small sets so ties on zone, capacity and preference are common.
func placeRandomCase(rng *rand.Rand) ([]*storpb.Server, PlaceRequest) {
	zonePool := []string{"", "a", "b", "c", "d"}
	zones := zonePool[rng.IntN(len(zonePool)):]
	zones = zones[:1+rng.IntN(len(zones))]
	n := rng.IntN(13)
	perm := rng.Perm(20)
	servers := make([]*storpb.Server, n)
	for i := range servers {
		s := placeSrv(fmt.Sprintf("s%02d", perm[i]), zones[rng.IntN(len(zones))])
		switch r := rng.IntN(10); {
		case r == 0:
			s.State = storpb.ServerState_SERVER_STATE_DOWN
		case r == 1:
			s.State = storpb.ServerState_SERVER_STATE_DRAINING
		case r == 2 && rng.IntN(2) == 0:
			s.State = storpb.ServerState_SERVER_STATE_UNSPECIFIED
		}
		if rng.IntN(4) > 0 {
			s.CapacityBytes = []uint64{50, 100, 100, 200}[rng.IntN(4)]
		}
		s.AllocatedBytes = []uint64{0, 0, 10, 50, 60, 150, 250}[rng.IntN(7)]
		if rng.IntN(2) == 0 {
			s.Labels = map[string]string{"rack": fmt.Sprint(rng.IntN(2))}
		}
		servers[i] = s
	}

	req := PlaceRequest{
		Replicas:  rng.IntN(7),
		SizeBytes: []uint64{0, 1, 40, 50, 90, 100}[rng.IntN(6)],
	}
	if rng.IntN(20) > 0 && req.Replicas == 0 {
		req.Replicas = 1 // keep invalid requests rare
	}
	for _, s := range servers {
		if rng.IntN(6) == 0 {
			req.Existing = append(req.Existing, s.Id)
		}
	}
	if rng.IntN(10) == 0 {
		req.Existing = append(req.Existing, "gone")
	}
	if len(req.Existing) > 0 && rng.IntN(10) == 0 {
		req.Existing = append(req.Existing, req.Existing[0])
	}
	rng.Shuffle(len(req.Existing), func(i, j int) { req.Existing[i], req.Existing[j] = req.Existing[j], req.Existing[i] })

	topo := func() *storpb.Topology {
		t := placeTopo()
		for range 1 + rng.IntN(2) {
			switch rng.IntN(3) {
			case 0:
				if n > 0 && rng.IntN(5) > 0 {
					t.Segments[TopologyKeyNode] = servers[rng.IntN(n)].Id
				} else {
					t.Segments[TopologyKeyNode] = "gone"
				}
			case 1:
				t.Segments[TopologyKeyZone] = zonePool[rng.IntN(len(zonePool))]
			case 2:
				t.Segments["rack"] = fmt.Sprint(rng.IntN(2))
			}
		}
		return t
	}
	if rng.IntN(5) < 3 {
		req.Accessibility = &storpb.TopologyRequirement{}
		for range rng.IntN(3) {
			req.Accessibility.Requisite = append(req.Accessibility.Requisite, topo())
		}
		for range rng.IntN(4) {
			req.Accessibility.Preferred = append(req.Accessibility.Preferred, topo())
		}
	}
	return servers, req
}

// placeCheckResult judges Place's answer against an independent reading of
// the rules. It returns a label for the kind of case and, if the answer is
// wrong, what is wrong with it.
func placeCheckResult(servers []*storpb.Server, req PlaceRequest, got []string, err error) (outcome, problem string) {
	if req.Replicas < 1 {
		if !errors.Is(err, ErrInvalidArgument) {
			return "invalid", fmt.Sprintf("want ErrInvalidArgument for %d replicas", req.Replicas)
		}
		return "invalid", ""
	}
	byID := map[string]*storpb.Server{}
	for _, s := range servers {
		byID[s.Id] = s
	}
	holding := map[string]bool{}
	for _, id := range req.Existing {
		holding[id] = true
	}
	matchesAny := func(ts []*storpb.Topology, s *storpb.Server) bool {
		for _, t := range ts {
			if TopologyMatches(t, s) {
				return true
			}
		}
		return len(ts) == 0
	}
	var candidates, eligible []*storpb.Server
	for _, s := range servers {
		if s.State != storpb.ServerState_SERVER_STATE_UP || holding[s.Id] ||
			!matchesAny(req.Accessibility.GetRequisite(), s) {
			continue
		}
		candidates = append(candidates, s)
		// Unreported capacity is unlimited; over-allocation leaves 0 free.
		if s.CapacityBytes == 0 || req.SizeBytes <= s.CapacityBytes-min(s.AllocatedBytes, s.CapacityBytes) {
			eligible = append(eligible, s)
		}
	}
	switch {
	case len(candidates) < req.Replicas:
		if !errors.Is(err, ErrInsufficientServers) {
			return "servers", fmt.Sprintf("want ErrInsufficientServers: %d replicas, %d candidates", req.Replicas, len(candidates))
		}
		return "servers", ""
	case len(eligible) < req.Replicas:
		if !errors.Is(err, ErrInsufficientCapacity) {
			return "capacity", fmt.Sprintf("want ErrInsufficientCapacity: %d replicas, %d of %d candidates with room",
				req.Replicas, len(eligible), len(candidates))
		}
		return "capacity", ""
	case err != nil:
		return "ok", fmt.Sprintf("unexpected error: %d replicas, %d eligible", req.Replicas, len(eligible))
	}

	// Success: exactly Replicas distinct eligible servers.
	if len(got) != req.Replicas {
		return "ok", fmt.Sprintf("got %d servers, want %d", len(got), req.Replicas)
	}
	isEligible := map[string]bool{}
	for _, s := range eligible {
		isEligible[s.Id] = true
	}
	chosen := map[string]bool{}
	for _, id := range got {
		if !isEligible[id] {
			return "ok", fmt.Sprintf("%s is not eligible", id)
		}
		if chosen[id] {
			return "ok", fmt.Sprintf("%s chosen twice", id)
		}
		chosen[id] = true
	}

	// The first replica honours the first preferred topology that can be.
	var prefTopo *storpb.Topology // the topology the first pick must match, if any
	for _, p := range req.Accessibility.GetPreferred() {
		if slices.ContainsFunc(eligible, func(s *storpb.Server) bool { return TopologyMatches(p, s) }) {
			prefTopo = p
			break
		}
	}
	pinned := prefTopo != nil
	okOutcome := "ok"
	if pinned {
		okOutcome = "ok-preferred"
	}
	if pinned && !TopologyMatches(prefTopo, byID[got[0]]) {
		return "ok", fmt.Sprintf("first pick %s does not match preferred %v", got[0], prefTopo)
	}

	// Zone spread. count = replicas per zone, existing ones included.
	existingCount := map[string]int{}
	for id := range holding {
		if s := byID[id]; s != nil {
			existingCount[s.Zone]++
		}
	}
	count := func(ids []string) map[string]int {
		c := map[string]int{}
		for z, n := range existingCount {
			c[z] = n
		}
		for _, id := range ids {
			c[byID[id].Zone]++
		}
		return c
	}
	final := count(got)

	// No single move improves the spread: moving a replica that is not
	// pinned by preference from zone z to an unused eligible server in zone
	// w would help iff count[z] > count[w]+1.
	for i, id := range got {
		if i == 0 && pinned {
			continue
		}
		z := byID[id].Zone
		for _, s := range eligible {
			if !chosen[s.Id] && s.Zone != z && final[z] > final[s.Zone]+1 {
				return "ok", fmt.Sprintf("zone spread not optimal: moving %s (zone %q, %d replicas) to %s (zone %q, %d replicas) improves it",
					id, z, final[z], s.Id, s.Zone, final[s.Zone])
			}
		}
	}

	// When nothing skews the spread (no existing replicas, no preference)
	// and every zone has servers enough, zone counts differ by at most 1.
	if len(holding) == 0 && !pinned {
		perZone := map[string]int{}
		for _, s := range eligible {
			perZone[s.Zone]++
		}
		roomy := true
		for _, n := range perZone {
			roomy = roomy && n >= req.Replicas
		}
		if roomy {
			lo, hi := req.Replicas, 0
			for z := range perZone {
				lo, hi = min(lo, final[z]), max(hi, final[z])
			}
			if hi-lo > 1 {
				return "ok", fmt.Sprintf("zone counts range %d..%d over zones %v", lo, hi, final)
			}
		}
	}

	// Small cases: brute force over every set of Replicas eligible servers
	// (containing a preferred one when the first pick is pinned). None may
	// spread better: lower sum of squared zone counts or lower maximum.
	if len(eligible) > 12 {
		return okOutcome + "-large", ""
	}
	sumSq := func(c map[string]int) (sum, hi int) {
		for _, n := range c {
			sum += n * n
			hi = max(hi, n)
		}
		return sum, hi
	}
	gotSum, gotMax := sumSq(final)
	for mask := uint(0); mask < 1<<len(eligible); mask++ {
		if bits.OnesCount(mask) != req.Replicas {
			continue
		}
		var ids []string
		hasPref := false
		for i, s := range eligible {
			if mask&(1<<i) != 0 {
				ids = append(ids, s.Id)
				hasPref = hasPref || (pinned && TopologyMatches(prefTopo, s))
			}
		}
		if pinned && !hasPref {
			continue
		}
		if sum, hi := sumSq(count(ids)); sum < gotSum || hi < gotMax {
			return "ok", fmt.Sprintf("%v spreads better than %v: sum of squares %d < %d or max %d < %d",
				ids, got, sum, gotSum, hi, gotMax)
		}
	}
	return okOutcome, ""
}

func placeFormatServers(servers []*storpb.Server) string {
	var b strings.Builder
	for _, s := range servers {
		if s == nil {
			b.WriteString("\n    <nil>")
			continue
		}
		fmt.Fprintf(&b, "\n    %s zone=%q %s cap=%d alloc=%d labels=%v",
			s.Id, s.Zone, s.State, s.CapacityBytes, s.AllocatedBytes, s.Labels)
	}
	return b.String()
}

func placeFormatRequest(req PlaceRequest) string {
	a := req.Accessibility
	return fmt.Sprintf("replicas=%d size=%d existing=%q requisite=%v preferred=%v (accessibility nil: %v)",
		req.Replicas, req.SizeBytes, req.Existing, a.GetRequisite(), a.GetPreferred(), a == nil)
}

// A preferred "node" segment naming the Kubernetes node a server runs on
// (not its id) puts the primary on that server: CSI's selected node is a
// Kubernetes node, deploy/'s server ids are pod names.
func TestPlacePreferredKubernetesNode(t *testing.T) {
	servers := []*storpb.Server{
		placeSrv("stor-server-0", "a", placeK8sNode("worker-a")),
		placeSrv("stor-server-1", "a", placeK8sNode("worker-b")),
		placeSrv("stor-server-2", "b", placeK8sNode("worker-c")),
		placeSrv("stor-server-3", "b", placeK8sNode("worker-d")),
	}
	for _, tc := range []struct{ node, want string }{
		{"worker-b", "stor-server-1"},
		{"worker-d", "stor-server-3"},
		{"stor-server-3", "stor-server-3"}, // a server id still matches
	} {
		got, err := Place(servers, PlaceRequest{
			Replicas:      2,
			Accessibility: placeAccess(nil, []*storpb.Topology{placeTopo("node", tc.node)}),
		})
		if err != nil || len(got) != 2 || got[0] != tc.want {
			t.Errorf("preferred node %s: placed %v, %v; want the primary on %s", tc.node, got, err, tc.want)
		}
	}
}
