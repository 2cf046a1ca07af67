// Package pvcevents mirrors stor's events (raftstore's event log, read
// with ClusterService.ListEvents) onto the PersistentVolumeClaims whose
// volumes they are about, as Kubernetes Events, so that kubectl describe
// pvc shows a replica's fault, a rebuild, an attach or a takeover where a
// platform team looks first.
//
// It runs in the CSI controller (stor-csi --mode=controller --pvc-events).
// Of the controller's replicas only the holder of a Lease mirrors
// (client-go leader election), so each event is posted once. A new holder
// starts at the newest stor event: what happened while no controller held
// the Lease is in stor's own log (stor-ctl events), not posted twice.
//
// A stor volume provisioned by the external-provisioner is named as its
// PersistentVolume (pvc-<uid>); the PV's claimRef names the claim. Events
// about other volumes, or about no volume, are not posted.
package pvcevents

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"

	storpb "github.com/stor-io/stor/api/proto"
)

// Component is the Events' source.
const Component = "stor-csi-controller"

// LeaseName is the Lease the controllers hold to mirror.
const LeaseName = "stor-csi-pvc-events"

// EventLister reads stor's events.
type EventLister interface {
	ListEvents(ctx context.Context, in *storpb.ListEventsRequest, opts ...grpc.CallOption) (*storpb.ListEventsResponse, error)
}

// Config configures Run.
type Config struct {
	Events EventLister
	Core   corev1client.CoreV1Interface                 // PVs read, Events created
	Leases coordinationv1client.CoordinationV1Interface // the Lease
	// Namespace of the Lease; Identity this process's (the pod name).
	Namespace, Identity string
	// Interval between reads of stor's events. Default 2s.
	Interval time.Duration
	Logger   *slog.Logger
}

// Run mirrors while it holds the Lease, until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Interval <= 0 {
		cfg.Interval = 2 * time.Second
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Name: LeaseName, Namespace: cfg.Namespace},
		Client:     cfg.Leases,
		LockConfig: resourcelock.ResourceLockConfig{Identity: cfg.Identity},
	}
	for ctx.Err() == nil {
		le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
			Lock: lock, ReleaseOnCancel: true,
			LeaseDuration: 15 * time.Second, RenewDeadline: 10 * time.Second, RetryPeriod: 2 * time.Second,
			Callbacks: leaderelection.LeaderCallbacks{
				OnStartedLeading: func(ctx context.Context) {
					cfg.Logger.Info("mirroring stor events onto PVCs", "lease", LeaseName)
					if err := mirror(ctx, cfg); err != nil && ctx.Err() == nil {
						cfg.Logger.Warn("mirroring stor events stopped", "err", err)
					}
				},
				OnStoppedLeading: func() {},
			},
		})
		if err != nil {
			return err
		}
		le.Run(ctx) // returns when leadership is lost or ctx ends
	}
	return nil
}

// mirror posts every stor event after the newest one at its start, until
// ctx ends.
func mirror(ctx context.Context, cfg Config) error {
	head, err := newest(ctx, cfg.Events)
	if err != nil {
		return err
	}
	t := time.NewTicker(cfg.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		resp, err := cfg.Events.ListEvents(ctx, &storpb.ListEventsRequest{AfterSeq: head})
		if err != nil {
			cfg.Logger.Debug("reading stor events", "err", err)
			continue
		}
		for _, e := range resp.GetEvents() {
			head = max(head, e.GetSeq())
			if err := post(ctx, cfg, e); err != nil {
				cfg.Logger.Warn("posting a stor event on its PVC", "seq", e.GetSeq(), "volume", e.GetVolumeName(), "volume_id", e.GetVolumeId(), "err", err)
			}
		}
	}
}

// newest is the sequence number of the newest stor event (0: none).
func newest(ctx context.Context, l EventLister) (uint64, error) {
	var head uint64
	for {
		resp, err := l.ListEvents(ctx, &storpb.ListEventsRequest{AfterSeq: head})
		if err != nil {
			return 0, err
		}
		evs := resp.GetEvents()
		if len(evs) == 0 {
			return head, nil
		}
		head = evs[len(evs)-1].GetSeq()
	}
}

// warnings are the reasons posted as Warning events: a replica or a
// snapshot's copy lost, a snapshot or a clone that failed, a takeover.
var warnings = map[string]bool{"ReplicaFaulty": true, "TakenOver": true, "SnapshotFailed": true, "SnapshotCopyLost": true, "CloneFailed": true}

// post creates e as an Event on its volume's claim, if it has one.
func post(ctx context.Context, cfg Config, e *storpb.Event) error {
	if e.GetVolumeName() == "" {
		return nil
	}
	pv, err := cfg.Core.PersistentVolumes().Get(ctx, e.GetVolumeName(), metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil // not a volume of a PV
	}
	if err != nil {
		return err
	}
	claim := pv.Spec.ClaimRef
	if claim == nil {
		return nil
	}
	typ := corev1.EventTypeNormal
	if warnings[e.GetReason()] {
		typ = corev1.EventTypeWarning
	}
	at := metav1.NewTime(time.Unix(0, e.GetAtUnixNano()))
	ev := &corev1.Event{
		ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("%s.stor%d", claim.Name, e.GetSeq()), Namespace: claim.Namespace},
		InvolvedObject: corev1.ObjectReference{Kind: "PersistentVolumeClaim", APIVersion: "v1",
			Namespace: claim.Namespace, Name: claim.Name, UID: claim.UID},
		Reason: e.GetReason(), Message: e.GetMessage(), Type: typ,
		Source:         corev1.EventSource{Component: Component},
		FirstTimestamp: at, LastTimestamp: at, Count: 1,
		ReportingController: "csi.stor.io/" + Component, ReportingInstance: cfg.Identity,
	}
	_, err = cfg.Core.Events(claim.Namespace).Create(ctx, ev, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return nil // posted before a leadership change
	}
	return err
}
