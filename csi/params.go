package csi

import (
	"cmp"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"sort"
	"strconv"
	"strings"

	csipb "github.com/container-storage-interface/spec/lib/go/csi"

	storpb "github.com/stor-io/stor/api/proto"
)

// StorageClass parameter keys.
const (
	ParamReplicas = "replicas"
	ParamFSType   = "fsType"
	// sidecarPrefix marks parameters the CSI sidecars add or consume.
	sidecarPrefix = "csi.storage.k8s.io/"
	// DefaultFSType is the filesystem of a mount volume without one.
	DefaultFSType = "ext4"
)

// supportedFS are the filesystems the node formats.
var supportedFS = map[string]bool{"ext4": true, "xfs": true}

// volumeParams are the validated StorageClass parameters.
type volumeParams struct {
	replicas uint32
	fsType   string // "" when not given
}

func parseParams(p map[string]string) (volumeParams, error) {
	out := volumeParams{replicas: DefaultReplicas}
	for k, v := range p {
		switch {
		case k == ParamReplicas:
			n, err := strconv.ParseUint(v, 10, 32)
			if err != nil || n < 1 || n > MaxReplicas {
				return out, invalidf("parameter %s=%q: want a replica count from 1 to %d", k, v, MaxReplicas)
			}
			out.replicas = uint32(n)
		case k == ParamFSType:
			if !supportedFS[strings.ToLower(v)] {
				return out, invalidf("parameter %s=%q: want ext4 or xfs", k, v)
			}
			out.fsType = strings.ToLower(v)
		case strings.HasPrefix(k, sidecarPrefix):
		default:
			return out, invalidf("unknown parameter %q (known: %s, %s)", k, ParamReplicas, ParamFSType)
		}
	}
	return out, nil
}

// storedParams are the parameters recorded on the stor volume (what makes
// a repeated CreateVolume with other parameters ALREADY_EXISTS).
func (p volumeParams) stored() map[string]string {
	m := map[string]string{}
	if p.fsType != "" {
		m[ParamFSType] = p.fsType
	}
	return m
}

// roundSize applies the capacity range: DefaultVolumeSize without one,
// else the required bytes (or the limit when only it is given) rounded
// up to BlockSize.
func roundSize(r *csipb.CapacityRange) (uint64, error) {
	req, lim := r.GetRequiredBytes(), r.GetLimitBytes()
	switch {
	case req < 0 || lim < 0:
		return 0, invalidf("capacity range %d..%d: negative", req, lim)
	case lim > 0 && req > lim:
		return 0, invalidf("capacity range: required %d is more than the limit %d", req, lim)
	}
	size := uint64(req)
	if size == 0 {
		size = DefaultVolumeSize
		if lim > 0 && uint64(lim) < size {
			size = uint64(lim) / BlockSize * BlockSize
		}
	}
	size = (size + BlockSize - 1) / BlockSize * BlockSize
	switch {
	case size == 0:
		return 0, fmt.Errorf("%w: the limit %d is below the block size %d", ErrOutOfRange, lim, BlockSize)
	case lim > 0 && size > uint64(lim):
		return 0, fmt.Errorf("%w: %d bytes rounded up to a multiple of %d is %d, above the limit %d", ErrOutOfRange, req, BlockSize, size, lim)
	case size > MaxVolumeSize:
		return 0, fmt.Errorf("%w: %d bytes is above the largest volume (%d)", ErrOutOfRange, size, uint64(MaxVolumeSize))
	}
	return size, nil
}

// checkCaps validates volume capabilities: single-node access modes,
// mount (ext4 or xfs) or block access.
func checkCaps(caps []*csipb.VolumeCapability) error {
	if len(caps) == 0 {
		return invalidf("no volume capabilities")
	}
	for _, c := range caps {
		if err := checkCap(c); err != nil {
			return err
		}
	}
	return nil
}

func checkCap(c *csipb.VolumeCapability) error {
	if c == nil {
		return invalidf("a volume capability is empty")
	}
	switch c.GetAccessMode().GetMode() {
	case csipb.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csipb.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csipb.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csipb.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
	case csipb.VolumeCapability_AccessMode_UNKNOWN:
		return invalidf("a volume capability has no access mode")
	default:
		return fmt.Errorf("%w: access mode %v: a stor volume is attached to one node at a time", ErrUnsupported, c.GetAccessMode().GetMode())
	}
	switch t := c.GetAccessType().(type) {
	case *csipb.VolumeCapability_Block:
	case *csipb.VolumeCapability_Mount:
		if fs := strings.ToLower(t.Mount.GetFsType()); fs != "" && !supportedFS[fs] {
			return fmt.Errorf("%w: filesystem %q: want ext4 or xfs", ErrUnsupported, t.Mount.GetFsType())
		}
	default:
		return invalidf("a volume capability has neither mount nor block access")
	}
	return nil
}

// topology keys: "topology.<driver>/node" and "topology.<driver>/zone".
func (d *Driver) nodeKey() string { return "topology." + d.cfg.DriverName + "/node" }
func (d *Driver) zoneKey() string { return "topology." + d.cfg.DriverName + "/zone" }

// placement turns CSI accessibility requirements into the cluster's
// placement requirement. Any node that reaches the cluster can attach a
// stor volume, so a node segment only expresses where the volume will be
// used: node segments (preferred first, then requisite) become placement
// preferences (a replica on the server whose id or Kubernetes node that
// is, for data locality), never a restriction. The zones of the requisite
// topologies restrict the replicas to those zones, each zone once; a
// requisite topology without a zone restricts nothing. Preferred zones are
// preferences.
//
// With csi-provisioner's non-strict topology (deploy/) the requisite holds
// the segment of every node that has the selected node's topology keys: a
// claim can place replicas in every zone the nodes report.
func (d *Driver) placement(req *csipb.TopologyRequirement) (requisite, preferred []*storpb.Topology, err error) {
	req_, err := d.toStorTopology(req.GetRequisite())
	if err != nil {
		return nil, nil, err
	}
	pref, err := d.toStorTopology(req.GetPreferred())
	if err != nil {
		return nil, nil, err
	}
	zones := map[string]bool{}
	for _, t := range req_ {
		z, ok := t.Segments["zone"]
		if !ok {
			requisite = nil
			break
		}
		if !zones[z] {
			zones[z] = true
			requisite = append(requisite, &storpb.Topology{Segments: map[string]string{"zone": z}})
		}
	}
	seen := map[string]bool{}
	for _, t := range append(pref, req_...) {
		k := t.Segments["node"] + "\x00" + t.Segments["zone"]
		if !seen[k] {
			seen[k] = true
			preferred = append(preferred, t)
		}
	}
	return requisite, preferred, nil
}

// toStorTopology maps CSI segments to the placement's "node" and "zone".
func (d *Driver) toStorTopology(ts []*csipb.Topology) ([]*storpb.Topology, error) {
	var out []*storpb.Topology
	for _, t := range ts {
		seg := map[string]string{}
		for k, v := range t.GetSegments() {
			switch k {
			case d.nodeKey():
				seg["node"] = v
			case d.zoneKey():
				seg["zone"] = v
			default:
				return nil, invalidf("topology key %q: want %s or %s", k, d.nodeKey(), d.zoneKey())
			}
		}
		out = append(out, &storpb.Topology{Segments: seg})
	}
	return out, nil
}

// accessibleTopology is a volume's accessible_topology, which
// csi-provisioner turns into the PV's node affinity: what constrains
// access, and nothing else. That is the zones its replicas are restricted
// to (the requisite placement recorded, zones only, each once), or no
// topology at all (reachable from every node). Never a node segment: a PV
// pinned to the nodes of its birth would refuse every node added later,
// while any node that reaches the cluster can attach the volume.
func (d *Driver) accessibleTopology(v *storpb.Volume) []*csipb.Topology {
	var out []*csipb.Topology
	seen := map[string]bool{}
	for _, t := range v.GetAccessibility().GetRequisite() {
		z, ok := t.GetSegments()["zone"]
		if !ok {
			return nil // a requisite topology without a zone: anywhere
		}
		if !seen[z] {
			seen[z] = true
			out = append(out, &csipb.Topology{Segments: map[string]string{d.zoneKey(): z}})
		}
	}
	return out
}

// capacityZones returns the zones a claim from a node in zone can place
// replicas in, under csi-provisioner's non-strict topology: its requisite
// is the segment of every node with the selected node's topology keys,
// so a node with a zone brings the zones of every node that reports one
// (registered nodes report the zone their node plugin gives NodeGetInfo;
// a node record is never removed, so a zone whose nodes are all gone still
// counts),
// and a node without one brings a requisite term without a zone, which
// restricts nothing (all is true).
func capacityZones(zone string, hasZone bool, nodes []*storpb.Node) (zones map[string]bool, all bool) {
	if !hasZone {
		return nil, true
	}
	zones = map[string]bool{zone: true}
	for _, n := range nodes {
		if n.GetZone() != "" {
			zones[n.GetZone()] = true
		}
	}
	return zones, false
}

// capacity computes GetCapacity's answer over the free bytes of the
// servers placement may use (see serverFree: an unreported
// capacity is unlimited, math.MaxUint64) for volumes of the given replica
// count, on distinct servers:
//
//   - maximum is the largest volume that fits: the replicas-th largest
//     free space (0 with fewer servers than replicas);
//   - available is the most volume bytes the servers can hold together:
//     the largest C with sum(min(free_i, C)) >= replicas*C (a volume puts
//     at most one replica on a server, so a server can hold at most C of
//     them), which is min over k < replicas of (the free bytes of all but
//     the k largest) / (replicas - k).
//
// Both are clamped to MaxVolumeSize / math.MaxInt64 and rounded down to
// BlockSize.
func capacity(free []uint64, replicas int) (available, maximum uint64) {
	if replicas < 1 || len(free) < replicas {
		return 0, 0
	}
	free = slices.Clone(free)
	slices.SortFunc(free, func(a, b uint64) int { return cmp.Compare(b, a) })
	maximum = min(free[replicas-1], MaxVolumeSize) / BlockSize * BlockSize
	var rest uint64 // free bytes of all but the k largest, saturating
	for _, f := range free[replicas-1:] {
		rest = satAdd(rest, f)
	}
	available = math.MaxUint64
	for k := replicas - 1; k >= 0; k-- {
		available = min(available, rest/uint64(replicas-k))
		if k > 0 {
			rest = satAdd(rest, free[k-1])
		}
	}
	return min(available, math.MaxInt64) / BlockSize * BlockSize, maximum
}

func satAdd(a, b uint64) uint64 {
	s, carry := bits.Add64(a, b, 0)
	if carry != 0 {
		return math.MaxUint64
	}
	return s
}

// serverFree is a server's free bytes as placement counts them
// (raftstore.ProvisionableBytes, repeated here so that the CSI driver does
// not link the Raft store): its capacity times the cluster's
// over-provisioning percent (ListServersResponse; 0 from a cluster older
// than the setting means 100) / 100, less what is promised to its
// replicas; unlimited (math.MaxUint64) when it has not reported a
// capacity, 0 when it is over-allocated.
func serverFree(s *storpb.Server, percent uint32) uint64 {
	if percent == 0 {
		percent = 100
	}
	total, allocated := s.GetCapacityBytes(), s.GetAllocatedBytes()
	if total == 0 {
		return math.MaxUint64
	}
	hi, lo := bits.Mul64(total, uint64(percent))
	if hi >= 100 {
		return math.MaxUint64
	}
	limit, _ := bits.Div64(hi, lo, 100)
	if allocated >= limit {
		return 0
	}
	return limit - allocated
}

// health is a volume's health as the cluster records it: DEGRADED when
// replicas are faulty or rebuilding (or fewer than the replica count are
// healthy), INACCESSIBLE when none is healthy; no entries when healthy.
// (CSI 1.13 replaced the VolumeCondition of 1.12 with VolumeHealth.)
func health(v *storpb.Volume) *csipb.VolumeHealth {
	out := &csipb.VolumeHealth{VolumeId: v.GetId()}
	var healthy int
	var bad []string
	for _, r := range v.GetReplicas() {
		if r.GetServerRemoved() {
			continue
		}
		switch r.GetState() {
		case storpb.ReplicaState_REPLICA_STATE_HEALTHY:
			healthy++
		case storpb.ReplicaState_REPLICA_STATE_REBUILDING:
			bad = append(bad, fmt.Sprintf("replica %s on %s is rebuilding", r.GetId(), r.GetServerId()))
		default:
			bad = append(bad, fmt.Sprintf("replica %s on %s is faulty", r.GetId(), r.GetServerId()))
		}
	}
	sort.Strings(bad)
	switch {
	case healthy == 0:
		out.HealthStatuses = []*csipb.VolumeHealth_VolumeHealthEntry{{
			Status: csipb.VolumeHealthErrorType_INACCESSIBLE, Reason: "NoHealthyReplica",
			Message: "no healthy replica: " + strings.Join(bad, "; "),
		}}
	case healthy < int(v.GetReplicaCount()) || len(bad) > 0:
		out.HealthStatuses = []*csipb.VolumeHealth_VolumeHealthEntry{{
			Status: csipb.VolumeHealthErrorType_DEGRADED, Reason: "ReplicasNotHealthy",
			Message: fmt.Sprintf("%d of %d replicas healthy; %s", healthy, v.GetReplicaCount(), strings.Join(bad, "; ")),
		}}
	}
	return out
}
