package raftstore

import (
	"fmt"
	"slices"
	"strings"

	storpb "github.com/stor-io/stor/api/proto"
)

// Topology segment keys the placement understands. A segment with any other
// key is matched against the server's label of that name.
const (
	// TopologyKeyNode matches a server's id or the Kubernetes node it runs
	// on (its kubernetes_node).
	TopologyKeyNode = "node"
	// TopologyKeyZone matches a server's zone.
	TopologyKeyZone = "zone"
)

// PlaceRequest describes replicas to place.
type PlaceRequest struct {
	// Replicas is how many new replicas to place; at least 1.
	Replicas int
	// SizeBytes is each replica's size; a server receives one only if it has
	// that much free capacity.
	SizeBytes uint64
	// OverProvisioningPercent is the cluster's over-provisioning ratio
	// (ClusterConfig); 0 means the default, 100. See ProvisionableBytes.
	OverProvisioningPercent uint32
	// Accessibility restricts (requisite) and steers (preferred) the choice,
	// with CSI semantics. May be nil: any server, no preference.
	Accessibility *storpb.TopologyRequirement
	// Existing are server ids already holding a replica of this volume (when
	// placing replacements). They are never chosen again and count toward
	// zone spreading, whatever their state. Ids not among the servers passed
	// to Place are ignored (their zone is unknown); duplicates count once.
	Existing []string
}

// TopologyMatches reports whether server s lies in topology t: every segment
// of t must match. Key [TopologyKeyNode] matches the server's id or its
// Kubernetes node (kubernetes_node; an unset one matches nothing): CSI names
// Kubernetes nodes, stor-ctl and tests name servers. [TopologyKeyZone]
// compares to the server's zone, any other key to the server's label of that
// name; a missing label never matches, not even an empty value. A nil or
// empty topology matches every server; a nil server matches nothing.
func TopologyMatches(t *storpb.Topology, s *storpb.Server) bool {
	if s == nil {
		return false
	}
	// Map iteration order does not matter: the result is a conjunction.
	for k, v := range t.GetSegments() {
		switch k {
		case TopologyKeyNode:
			if s.GetId() != v && (s.GetKubernetesNode() == "" || s.GetKubernetesNode() != v) {
				return false
			}
		case TopologyKeyZone:
			if s.GetZone() != v {
				return false
			}
		default:
			l, ok := s.GetLabels()[k]
			if !ok || l != v {
				return false
			}
		}
	}
	return true
}

// Place chooses the servers for req.Replicas new replicas and returns their
// ids in order; the first is the primary (the preferred one, see below).
//
// Place is a pure function of its arguments: no clock, no randomness, no
// dependence on map iteration order or on the order of servers. It runs
// inside the Raft FSM apply and gives the same answer on every server. It
// never modifies servers or req.
//
// A server is eligible when all of these hold:
//   - its state is SERVER_STATE_UP (down, draining and unspecified servers
//     never receive replicas) and it is not cordoned;
//   - it is not in req.Existing;
//   - it matches at least one requisite topology, if any are given
//     (see [TopologyMatches]);
//   - its free capacity, capacity_bytes * req.OverProvisioningPercent / 100
//     less allocated_bytes ([ProvisionableBytes]), is at least req.SizeBytes.
//     capacity_bytes == 0 means the server has not reported its capacity
//     and is treated as unlimited; allocated_bytes above that limit leaves
//     no free capacity.
//
// Replicas always go to distinct servers. Picks are greedy, one at a time,
// each taking the eligible server that ranks first by:
//  1. fewest replicas in its zone so far, counting the zones of
//     req.Existing servers and of earlier picks (an empty zone is the zone
//     ""), which spreads replicas over as many zones as possible;
//  2. earliest preferred topology it matches (servers matching none rank
//     after all that match one);
//  3. most free capacity (unlimited counts as the maximum);
//  4. lowest id.
//
// The first pick is the exception, following CSI: if any eligible server
// matches a preferred topology, the first replica goes to a server matching
// the first preferred topology that has an eligible server — for data
// locality, a preferred {"node": n} puts the primary on the server whose id
// or Kubernetes node is n — even
// when another zone holds fewer replicas. Rules 1, 3 and 4 choose among
// those servers.
//
// Errors:
//   - [ErrInvalidArgument] if req.Replicas < 1, or servers holds a nil
//     server, an empty id or an id twice;
//   - [ErrInsufficientServers] if fewer than req.Replicas servers are up
//     and not cordoned, not in req.Existing and match the requisite
//     topology, capacity aside; the message counts the servers excluded
//     for each reason;
//   - [ErrInsufficientCapacity] if there are enough such servers but fewer
//     than req.Replicas of them have req.SizeBytes free.
func Place(servers []*storpb.Server, req PlaceRequest) ([]string, error) {
	if req.Replicas < 1 {
		return nil, fmt.Errorf("placement: need at least 1 replica, asked for %d: %w", req.Replicas, ErrInvalidArgument)
	}
	// Validate without depending on the order of servers, so that even the
	// error message is the same for any order.
	byID := make(map[string]*storpb.Server, len(servers))
	var dups []string
	for _, s := range servers {
		switch {
		case s == nil:
			return nil, fmt.Errorf("placement: nil server among %d: %w", len(servers), ErrInvalidArgument)
		case s.GetId() == "":
			return nil, fmt.Errorf("placement: server without id among %d: %w", len(servers), ErrInvalidArgument)
		case byID[s.GetId()] != nil:
			dups = append(dups, s.GetId())
		}
		byID[s.GetId()] = s
	}
	if len(dups) > 0 {
		return nil, fmt.Errorf("placement: server %q listed twice: %w", slices.Min(dups), ErrInvalidArgument)
	}

	// Replicas per zone: the existing ones first, picks are added below.
	zoneCount := make(map[string]int)
	holding := make(map[string]bool, len(req.Existing))
	for _, id := range req.Existing {
		if holding[id] {
			continue
		}
		holding[id] = true
		if s := byID[id]; s != nil {
			zoneCount[s.GetZone()]++
		}
	}

	requisite := req.Accessibility.GetRequisite()
	preferred := req.Accessibility.GetPreferred()
	var (
		nHolding, nNotUp, nCordoned, nOutside int
		cands                                 []placeCandidate // eligible, capacity aside
	)
	for _, s := range servers {
		switch {
		case holding[s.GetId()]:
			nHolding++
		case s.GetState() != storpb.ServerState_SERVER_STATE_UP:
			nNotUp++
		case s.GetCordoned():
			nCordoned++
		case !placeMatchesAny(requisite, s):
			nOutside++
		default:
			free := ProvisionableBytes(s, req.OverProvisioningPercent)
			cands = append(cands, placeCandidate{
				id:   s.GetId(),
				zone: s.GetZone(),
				free: free,
				pref: placePreference(preferred, s),
				fits: free >= req.SizeBytes,
			})
		}
	}
	if len(cands) < req.Replicas {
		where := ""
		if len(requisite) > 0 {
			where = " in " + placeDescribe(requisite)
		}
		cordoned := ""
		if nCordoned > 0 {
			cordoned = fmt.Sprintf(", %d cordoned", nCordoned)
		}
		return nil, fmt.Errorf("placement: need %d servers%s, %d eligible of %d (%d not up%s, %d outside the requisite topology, %d already holding a replica): %w",
			req.Replicas, where, len(cands), len(servers), nNotUp, cordoned, nOutside, nHolding, ErrInsufficientServers)
	}

	eligible := make([]placeCandidate, 0, len(cands))
	var largestShort uint64 // most free capacity among candidates too small
	for _, c := range cands {
		if c.fits {
			eligible = append(eligible, c)
		} else {
			largestShort = max(largestShort, c.free)
		}
	}
	if len(eligible) < req.Replicas {
		return nil, fmt.Errorf("placement: need %d servers with %d bytes free, %d of %d eligible servers have it (the others at most %d bytes): %w",
			req.Replicas, req.SizeBytes, len(eligible), len(cands), largestShort, ErrInsufficientCapacity)
	}
	// Ranking is a total order (ids are unique), so the scan below does not
	// depend on input order; sorting makes that evident and cheap to check.
	slices.SortFunc(eligible, func(a, b placeCandidate) int { return strings.Compare(a.id, b.id) })

	// The first pick is restricted to the first preferred topology that has
	// an eligible server. A server matching it cannot match an earlier
	// preferred topology (that one would have an eligible server), so the
	// restriction is "pref == firstPref".
	firstPref := len(preferred)
	for _, c := range eligible {
		firstPref = min(firstPref, c.pref)
	}

	picks := make([]string, 0, req.Replicas)
	taken := make([]bool, len(eligible))
	for n := range req.Replicas {
		best := -1
		for i, c := range eligible {
			if taken[i] || (n == 0 && firstPref < len(preferred) && c.pref != firstPref) {
				continue
			}
			if best < 0 || placeBefore(c, eligible[best], zoneCount) {
				best = i
			}
		}
		// best >= 0: at least req.Replicas servers are eligible, and the
		// first pick's restriction leaves at least one.
		taken[best] = true
		zoneCount[eligible[best].zone]++
		picks = append(picks, eligible[best].id)
	}
	return picks, nil
}

// placeCandidate is a server Place may choose.
type placeCandidate struct {
	id   string
	zone string
	free uint64 // math.MaxUint64 when capacity is not reported
	pref int    // index of the first preferred topology matched; len(preferred) if none
	fits bool   // free >= the requested size
}

// placeBefore reports whether a ranks before b for the next pick, given the
// replicas per zone so far. See Place for the order.
func placeBefore(a, b placeCandidate, zoneCount map[string]int) bool {
	if za, zb := zoneCount[a.zone], zoneCount[b.zone]; za != zb {
		return za < zb
	}
	if a.pref != b.pref {
		return a.pref < b.pref
	}
	if a.free != b.free {
		return a.free > b.free
	}
	return a.id < b.id
}

// placeMatchesAny reports whether s matches one of ts; an empty ts
// (no requirement) matches every server.
func placeMatchesAny(ts []*storpb.Topology, s *storpb.Server) bool {
	if len(ts) == 0 {
		return true
	}
	return slices.ContainsFunc(ts, func(t *storpb.Topology) bool { return TopologyMatches(t, s) })
}

// placePreference returns the index of the first topology in preferred that
// s matches, or len(preferred) if none.
func placePreference(preferred []*storpb.Topology, s *storpb.Server) int {
	for i, t := range preferred {
		if TopologyMatches(t, s) {
			return i
		}
	}
	return len(preferred)
}

// placeDescribe renders topologies for error messages, deterministically:
// "zone=a or node=s1", segments of one topology sorted and joined by ",".
func placeDescribe(ts []*storpb.Topology) string {
	parts := make([]string, 0, len(ts))
	for _, t := range ts {
		segs := make([]string, 0, len(t.GetSegments()))
		for k, v := range t.GetSegments() {
			segs = append(segs, k+"="+v)
		}
		slices.Sort(segs)
		if len(segs) == 0 {
			segs = append(segs, "any topology")
		}
		parts = append(parts, strings.Join(segs, ","))
	}
	return strings.Join(parts, " or ")
}
