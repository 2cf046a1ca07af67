package pvcevents

import (
	"context"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"

	storpb "github.com/stor-io/stor/api/proto"
)

// storEvents is a fake stor event log.
type storEvents struct {
	mu  sync.Mutex
	evs []*storpb.Event
}

func (s *storEvents) add(e *storpb.Event) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e.Seq = uint64(len(s.evs) + 1)
	e.AtUnixNano = time.Now().UnixNano()
	s.evs = append(s.evs, e)
}

func (s *storEvents) ListEvents(_ context.Context, in *storpb.ListEventsRequest, _ ...grpc.CallOption) (*storpb.ListEventsResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*storpb.Event
	for _, e := range s.evs {
		if e.Seq > in.AfterSeq {
			out = append(out, e)
		}
	}
	return &storpb.ListEventsResponse{Events: out}, nil
}

// The controller holding the Lease posts each stor event about a PV's
// volume on the PV's claim, once; events from before it started, about
// volumes of no PV, or about no volume, are not posted.
func TestMirrorsEventsOntoClaims(t *testing.T) {
	kube := fake.NewClientset(&corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pvc-1"},
		Spec:       corev1.PersistentVolumeSpec{ClaimRef: &corev1.ObjectReference{Namespace: "apps", Name: "data", UID: "uid-1"}},
	})
	stor := &storEvents{}
	stor.add(&storpb.Event{VolumeName: "pvc-1", Reason: "VolumeCreated", Message: "before the mirror started"})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{Events: stor, Core: kube.CoreV1(), Leases: kube.CoordinationV1(), Namespace: "stor-system",
			Identity: "controller-0", Interval: 50 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	}()
	defer func() { cancel(); <-done }()

	// Once it holds the Lease, new events are posted.
	deadline := time.Now().Add(20 * time.Second)
	for {
		if l, err := kube.CoordinationV1().Leases("stor-system").Get(ctx, LeaseName, metav1.GetOptions{}); err == nil && l.Spec.HolderIdentity != nil && *l.Spec.HolderIdentity == "controller-0" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the Lease was not taken within 20 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // the mirror has read the newest event
	stor.add(&storpb.Event{VolumeName: "pvc-1", VolumeId: "v1", Reason: "ReplicaFaulty", Message: "replica r2 on server s2 faulty: disk error"})
	stor.add(&storpb.Event{VolumeName: "not-a-pv", Reason: "Attached", Message: "attached to node n1"})
	stor.add(&storpb.Event{ServerId: "s2", Reason: "ServerDown", Message: "server s2 down"})
	stor.add(&storpb.Event{VolumeName: "pvc-1", Reason: "Attached", Message: "attached to node n1 at epoch 2"})
	stor.add(&storpb.Event{VolumeName: "pvc-1", Reason: "CloneFailed", Message: `volume "pvc-1" can never be filled`})

	var evs []corev1.Event
	for {
		l, err := kube.CoreV1().Events("apps").List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if evs = l.Items; len(evs) >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d events on the claim's namespace within 20 s, want 3: %v", len(evs), evs)
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)
	l, _ := kube.CoreV1().Events("").List(ctx, metav1.ListOptions{})
	if len(l.Items) != 3 {
		t.Fatalf("%d events posted in all, want 3 (the claim's): %v", len(l.Items), l.Items)
	}
	got := map[string]corev1.Event{}
	for _, e := range evs {
		got[e.Reason] = e
		if e.InvolvedObject.Kind != "PersistentVolumeClaim" || e.InvolvedObject.Name != "data" || e.InvolvedObject.UID != "uid-1" || e.Source.Component != Component {
			t.Fatalf("event %s is on %+v from %q", e.Reason, e.InvolvedObject, e.Source.Component)
		}
	}
	if e := got["ReplicaFaulty"]; e.Type != corev1.EventTypeWarning || e.Message != "replica r2 on server s2 faulty: disk error" {
		t.Fatalf("ReplicaFaulty posted as %+v", e)
	}
	if e := got["Attached"]; e.Type != corev1.EventTypeNormal {
		t.Fatalf("Attached posted as %+v", e)
	}
	if e := got["CloneFailed"]; e.Type != corev1.EventTypeWarning {
		t.Fatalf("CloneFailed posted as %+v", e)
	}
}
