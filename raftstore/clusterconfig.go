package raftstore

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"time"

	"google.golang.org/protobuf/proto"

	storpb "github.com/stor-io/stor/api/proto"
)

// Bounds of the cluster-wide policy (storpb.ClusterConfig). A zero field is
// unset and takes the default.
const (
	// MinReplaceAfter and MaxReplaceAfter bound ClusterConfig's
	// replace_after_seconds: shorter than 30s replaces a replica whose
	// server merely restarts; longer than 7 days leaves a volume short of
	// a replica for longer than any maintenance window.
	MinReplaceAfter = 30 * time.Second
	MaxReplaceAfter = 7 * 24 * time.Hour
	// DefaultOverProvisioningPercent is the ratio when none is set: a
	// server is promised at most its capacity.
	DefaultOverProvisioningPercent = 100
	// MaxOverProvisioningPercent bounds the ratio (100 times the capacity).
	MaxOverProvisioningPercent = 10000
)

var keyClusterConfig = []byte("cluster_config")

// ClusterConfig returns the cluster-wide policy as set; an empty message
// when none was ever set (zero fields are unset).
func (r *Reader) ClusterConfig() (*storpb.ClusterConfig, error) {
	c := &storpb.ClusterConfig{}
	if err := r.get(bucketMeta, string(keyClusterConfig), c); err != nil && !errors.Is(err, ErrNotFound) {
		return nil, err
	}
	return c, nil
}

// overProvisioningPercent returns the ratio in force: the configured one,
// or DefaultOverProvisioningPercent. A corrupt record is reported.
func (r *Reader) overProvisioningPercent() (uint32, error) {
	c, err := r.ClusterConfig()
	if err != nil {
		return 0, err
	}
	return OverProvisioningPercent(c), nil
}

// OverProvisioningPercent is the ratio c puts in force (the default when
// it is unset or c is nil).
func OverProvisioningPercent(c *storpb.ClusterConfig) uint32 {
	if p := c.GetOverProvisioningPercent(); p != 0 {
		return p
	}
	return DefaultOverProvisioningPercent
}

// ProvisionableBytes is what more server s may be promised under the
// over-provisioning ratio percent (0 means the default, 100):
// capacity_bytes * percent / 100 - allocated_bytes, 0 when that is
// negative, and math.MaxUint64 when s has not reported a capacity
// (unlimited). Placement, volume expansion and the CSI GetCapacity answer
// all count free space this way.
func ProvisionableBytes(s *storpb.Server, percent uint32) uint64 {
	if percent == 0 {
		percent = DefaultOverProvisioningPercent
	}
	capacity, allocated := s.GetCapacityBytes(), s.GetAllocatedBytes()
	if capacity == 0 {
		return math.MaxUint64
	}
	hi, lo := bits.Mul64(capacity, uint64(percent))
	if hi >= 100 {
		return math.MaxUint64 // beyond 2^64 bytes: unlimited in practice
	}
	limit, _ := bits.Div64(hi, lo, 100)
	if allocated >= limit {
		return 0
	}
	return limit - allocated
}

// CheckClusterConfig reports the first out-of-range field of c as
// ErrInvalidArgument; zero fields (unset) are valid.
func CheckClusterConfig(c *storpb.ClusterConfig) error {
	if s := c.GetReplaceAfterSeconds(); s != 0 && (s < uint64(MinReplaceAfter/time.Second) || s > uint64(MaxReplaceAfter/time.Second)) {
		return fmt.Errorf("%w: cluster config: replace-after %v is outside %v..%v",
			ErrInvalidArgument, time.Duration(min(s, math.MaxInt64/uint64(time.Second)))*time.Second, MinReplaceAfter, MaxReplaceAfter)
	}
	if p := c.GetOverProvisioningPercent(); p != 0 && (p < DefaultOverProvisioningPercent || p > MaxOverProvisioningPercent) {
		return fmt.Errorf("%w: cluster config: over-provisioning %d%% is outside %d..%d%%",
			ErrInvalidArgument, p, DefaultOverProvisioningPercent, MaxOverProvisioningPercent)
	}
	return nil
}

// setClusterConfig merges the non-zero fields of in into the stored
// configuration (opSetClusterConfig). Nothing changes on a refusal.
func (w *writer) setClusterConfig(in *storpb.ClusterConfig) (proto.Message, error) {
	if err := CheckClusterConfig(in); err != nil {
		return nil, err
	}
	c, err := w.ClusterConfig()
	if err != nil {
		return nil, err
	}
	if in.ReplaceAfterSeconds != 0 {
		c.ReplaceAfterSeconds = in.ReplaceAfterSeconds
	}
	if in.OverProvisioningPercent != 0 {
		c.OverProvisioningPercent = in.OverProvisioningPercent
	}
	w.put(bucketMeta, string(keyClusterConfig), c)
	return c, nil
}

// ClusterConfig returns the cluster-wide policy as committed on this
// server (see Reader.ClusterConfig); callers wanting the latest read
// ConsistentRead first.
func (s *Store) ClusterConfig() (*storpb.ClusterConfig, error) {
	var c *storpb.ClusterConfig
	err := s.fsm.View(func(r *Reader) error {
		var err error
		c, err = r.ClusterConfig()
		return err
	})
	return c, err
}

// SetClusterConfig changes the cluster-wide policy: the non-zero fields of
// in replace the current values. An out-of-range value is
// ErrInvalidArgument and changes nothing. It returns the whole
// configuration after the change.
func (s *Store) SetClusterConfig(ctx context.Context, in *storpb.ClusterConfig) (*storpb.ClusterConfig, error) {
	if err := CheckClusterConfig(in); err != nil {
		return nil, err
	}
	if in.GetReplaceAfterSeconds() == 0 && in.GetOverProvisioningPercent() == 0 {
		return nil, fmt.Errorf("%w: cluster config: nothing to set", ErrInvalidArgument)
	}
	m, err := s.propose(ctx, command{Op: opSetClusterConfig, Body: &storpb.ClusterConfig{
		ReplaceAfterSeconds: in.ReplaceAfterSeconds, OverProvisioningPercent: in.OverProvisioningPercent,
	}})
	if err != nil {
		return nil, err
	}
	return m.(*storpb.ClusterConfig), nil
}

// replaceAfter is the replacement wait in force: the cluster config's, or
// this server's start-time Config.ReplaceAfter when none is set. The
// leader's repair loop reads it at every pass.
func (s *Store) replaceAfter(r *Reader) time.Duration {
	c, err := r.ClusterConfig()
	if err != nil || c.ReplaceAfterSeconds == 0 {
		return s.cfg.ReplaceAfter
	}
	return time.Duration(c.ReplaceAfterSeconds) * time.Second
}
